"""Batch plans: which groups of which shards each rank of a consumer group reads at one step.

The leader selects whole groups past the current position, oldest policy version first (a merge of the writers'
queues by the shard's minimum version; within a writer always in ``seq`` order so the position stays a prefix), until
it has the requested number of samples (or groups). Groups are then split into ``world_size`` contiguous runs of
near-equal sample counts (equal when groups have equal sizes and their number divides by ``world_size``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from relax_hpc.rundir import RunDir
from relax_hpc.store.layout import ShardRef, list_writers, scan_shards

StalePolicy = Literal["drop", "flag"]
_NOTHING = (0, 0, 0)


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

    max_groups = num_groups if num_groups is not None else math.inf
    max_samples = num_samples if num_samples is not None and num_groups is None else math.inf
    queues: dict[str, list[tuple[int, int, int, int, int]]] = {}
    heap: list[tuple[int, int, str]] = []
    for w in sorted(set(list_writers(rd)) | set(base)):
        seq, g, _ = sel.writers.get(w, _NOTHING)
        found = scan_shards(rd, w, seq)
        if g > 0 and (not found or found[0][0] != seq):
            moved = extra_refs(w, seq)
            if moved is not None:
                found.insert(0, (moved.seq, moved.num_samples, moved.num_groups, moved.min_version, moved.max_version))
        if found:
            found.reverse()  # the next shard is the last item
            queues[w] = found
            heapq.heappush(heap, (found[-1][3], found[-1][0], w))
    drop = stale_policy == "drop" and min_version is not None
    flag = stale_policy == "flag" and min_version is not None
    chosen = sel.groups
    count = total = 0
    while heap and count < max_groups and total < max_samples:
        _, _, w = heapq.heappop(heap)
        ref = ShardRef(w, *queues[w].pop())
        pos = sel.writers.get(w, _NOTHING)
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
                sizes, mins = info.group_sizes, info.group_min_version
                while g < ref.num_groups and count < max_groups and total < max_samples:
                    size = sizes[g]
                    if drop and mins[g] < min_version:
                        st["stale_dropped_samples"] += size
                        st["stale_dropped_groups"] += 1
                    else:
                        if idx < 0:
                            sel.shards.append(ref)
                            idx = len(sel.shards) - 1
                        chosen.append((idx, g, size))
                        count += 1
                        total += size
                        if flag and mins[g] < min_version:
                            st["stale_flagged_samples"] += sum(v < min_version for v in info.sample_versions[g])
                    g += 1
                    s += size
                if g < ref.num_groups:
                    sel.writers[w] = [ref.seq, g, s]
                    done = False
        if done:
            sel.writers[w] = [ref.seq + 1, 0, 0]
            if queues[w]:
                nxt = queues[w][-1]
                heapq.heappush(heap, (nxt[3], nxt[0], w))
    sel.samples = total
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
    total = sum([size for _, _, size in groups])
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
