"""Batch plans: which groups of which shards each rank of a consumer group reads at one step.

The leader selects whole groups past the current position, oldest policy version first (a merge of the writers'
queues by the shard's minimum version; within a writer always in ``seq`` order so the position stays a prefix), until
it has the requested number of samples (or groups). Groups are then split into ``world_size`` contiguous runs of
near-equal sample counts (equal when groups have equal sizes and their number divides by ``world_size``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from relax_hpc.rundir import RunDir
from relax_hpc.store.layout import ShardRef, list_shards, list_writers

StalePolicy = Literal["drop", "flag"]


@dataclass(frozen=True)
class Plan:
    """One step's batch: shards, each rank's ``(shard index, first group, end group)`` runs, and positions."""

    step: int
    consumer: str
    world_size: int
    shards: list[str]
    """Shards as ``<writer_id>/<name>``."""
    ranks: list[list[tuple[int, int, int]]]
    """Per rank: runs of groups ``[g0, g1)`` of ``shards[i]``."""
    rank_samples: list[int]
    position_before: dict[str, Any]
    position_after: dict[str, Any]
    min_version: int | None = None
    stale_policy: StalePolicy = "drop"
    stats: dict[str, Any] = field(default_factory=dict)
    """``samples``, ``groups``, ``stale_dropped_samples``/``_groups``, ``stale_flagged_samples``,
    ``quarantined_shards`` (names), ``quarantined_samples``."""

    @property
    def num_samples(self) -> int:
        return sum(self.rank_samples)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": 1,
            "step": self.step,
            "consumer": self.consumer,
            "world_size": self.world_size,
            "shards": self.shards,
            "ranks": [[list(r) for r in runs] for runs in self.ranks],
            "rank_samples": self.rank_samples,
            "position_before": self.position_before,
            "position_after": self.position_after,
            "min_version": self.min_version,
            "stale_policy": self.stale_policy,
            "stats": self.stats,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        return cls(
            step=int(data["step"]),
            consumer=data["consumer"],
            world_size=int(data["world_size"]),
            shards=list(data["shards"]),
            ranks=[[tuple(r) for r in runs] for runs in data["ranks"]],
            rank_samples=list(data["rank_samples"]),
            position_before=data["position_before"],
            position_after=data["position_after"],
            min_version=data.get("min_version"),
            stale_policy=data.get("stale_policy", "drop"),
            stats=dict(data.get("stats", {})),
        )


@dataclass
class GroupInfo:
    """What the planner needs from a shard's header: group sizes and each group's oldest version."""

    group_sizes: list[int]
    group_min_version: list[int]
    sample_versions: list[list[int]]


@dataclass
class Selection:
    """Result of :func:`select`: chosen groups in order and the position after them."""

    groups: list[tuple[int, int, int]] = field(default_factory=list)  # (shard index, group, size)
    shards: list[ShardRef] = field(default_factory=list)
    writers: dict[str, list[int]] = field(default_factory=dict)
    samples: int = 0
    stats: dict[str, Any] = field(default_factory=dict)


def select(
    rd: RunDir,
    base: dict[str, list[int]],
    *,
    num_samples: int | None,
    num_groups: int | None,
    min_version: int | None,
    stale_policy: StalePolicy,
    group_info: Callable[[ShardRef], GroupInfo | None],
    extra_refs: Callable[[str, int], ShardRef | None],
) -> Selection:
    """Pick groups past ``base`` until ``num_samples`` samples (or ``num_groups`` groups) are chosen or none are left.

    ``group_info(ref)`` returns None for a corrupt shard (the caller has quarantined it); ``extra_refs(writer, seq)``
    finds a partly consumed shard that is no longer in its writer folder (moved to quarantine by a reader).
    """
    sel = Selection(writers={w: list(e) for w, e in base.items()})
    st = {
        "stale_dropped_samples": 0,
        "stale_dropped_groups": 0,
        "stale_flagged_samples": 0,
        "quarantined_shards": [],
        "quarantined_samples": 0,
    }
    sel.stats = st

    def satisfied() -> bool:
        if num_groups is not None:
            return len(sel.groups) >= num_groups
        return num_samples is not None and sel.samples >= num_samples

    queues: dict[str, list[ShardRef]] = {}
    heap: list[tuple[int, int, str]] = []
    for w in sorted(set(list_writers(rd)) | set(base)):
        seq, g, _ = sel.writers.get(w, [0, 0, 0])
        refs = list_shards(rd, w, seq)
        if g > 0 and (not refs or refs[0].seq != seq):
            moved = extra_refs(w, seq)
            if moved is not None:
                refs.insert(0, moved)
        if refs:
            queues[w] = refs
            heapq.heappush(heap, (refs[0].min_version, refs[0].seq, w))
    drop = stale_policy == "drop" and min_version is not None
    while heap and not satisfied():
        _, _, w = heapq.heappop(heap)
        ref = queues[w].pop(0)
        pos = sel.writers.get(w, [0, 0, 0])
        g_start, s_start = (pos[1], pos[2]) if pos[0] == ref.seq else (0, 0)
        done = True
        if drop and ref.max_version < min_version:  # the whole rest of the shard is stale: no need to open it
            st["stale_dropped_samples"] += ref.num_samples - s_start
            st["stale_dropped_groups"] += ref.num_groups - g_start
        else:
            info = group_info(ref)
            if info is None:
                st["quarantined_shards"].append(ref.rel)
                st["quarantined_samples"] += ref.num_samples - s_start
            else:
                idx = -1
                g, s = g_start, s_start
                while g < ref.num_groups and not satisfied():
                    size = info.group_sizes[g]
                    if drop and info.group_min_version[g] < min_version:
                        st["stale_dropped_samples"] += size
                        st["stale_dropped_groups"] += 1
                    else:
                        if idx < 0:
                            sel.shards.append(ref)
                            idx = len(sel.shards) - 1
                        sel.groups.append((idx, g, size))
                        sel.samples += size
                        if min_version is not None:
                            st["stale_flagged_samples"] += sum(v < min_version for v in info.sample_versions[g])
                    g += 1
                    s += size
                if g < ref.num_groups:
                    sel.writers[w] = [ref.seq, g, s]
                    done = False
        if done:
            sel.writers[w] = [ref.seq + 1, 0, 0]
            if queues[w]:
                nxt = queues[w][0]
                heapq.heappush(heap, (nxt.min_version, nxt.seq, w))
    if not drop:
        st.pop("stale_dropped_samples")
        st.pop("stale_dropped_groups")
    if stale_policy != "flag" or min_version is None:
        st.pop("stale_flagged_samples")
    return sel


def split_ranks(
    groups: list[tuple[int, int, int]], world_size: int
) -> tuple[list[list[tuple[int, int, int]]], list[int]]:
    """Split chosen groups into contiguous per-rank runs ``(shard index, g0, g1)`` of near-equal sample counts."""
    total = sum(size for _, _, size in groups)
    ranks: list[list[tuple[int, int, int]]] = [[] for _ in range(world_size)]
    counts = [0] * world_size
    cum = 0
    for shard_idx, g, size in groups:
        # the rank whose share contains this group's midpoint
        r = min(world_size - 1, int((cum + size / 2) * world_size / total)) if total else 0
        cum += size
        runs = ranks[r]
        if runs and runs[-1][0] == shard_idx and runs[-1][2] == g:
            runs[-1] = (shard_idx, runs[-1][1], g + 1)
        else:
            runs.append((shard_idx, g, g + 1))
        counts[r] += size
    return ranks, counts
