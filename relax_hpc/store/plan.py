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
from relax_hpc.store.announce import Announced
from relax_hpc.store.layout import ShardRef, list_writers, scan_shards_cached

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


_Queue = list[tuple[int, int, int, int, int]]
"""A writer's shards not yet fully consumed, newest first: (seq, samples, groups, min version, max version)."""


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
    fresh_listing: bool = False,
    index: Announced | None = None,
    visible: Callable[[ShardRef], bool] | None = None,
) -> Selection:
    """Pick groups past ``base`` until ``num_samples`` samples (or ``num_groups`` groups) are chosen or none are left.

    Shards are taken oldest weights first across writers (a heap on each writer's next shard). ``group_info(ref)``
    returns None for a corrupt shard (the caller has quarantined it); ``extra_refs(writer, seq)`` finds a partly
    consumed shard that is no longer in its writer folder (moved to quarantine by a reader).

    With ``index`` (the announced shards, :func:`relax_hpc.store.announce.list_announced`) the writers' queues come
    from it instead of a listing of every writer folder; a writer whose announced ``seq`` do not continue its
    position without a gap is listed (``stats["index_gaps"]``). ``visible(ref)`` is then asked before a shard is
    taken: an announced shard that is not visible ends its writer's queue for this plan (``stats["index_missing"]``),
    it is never counted as lost.
    """
    sel = Selection(writers={w: list(e) for w, e in base.items()})
    sel.stats = {"stale_dropped_samples": 0, "stale_dropped_groups": 0, "stale_flagged_samples": 0,
                 "quarantined_shards": [], "quarantined_samples": 0}
    take = _Taker(sel, min_version, stale_policy,
                  max_groups=num_groups if num_groups is not None else math.inf,
                  max_samples=num_samples if num_samples is not None and num_groups is None else math.inf)
    if index is None:
        queues = _writer_queues(rd, sel, extra_refs, fresh_listing)
    else:
        queues = _index_queues(rd, sel, index, extra_refs)
    heap = [(q[-1][3], q[-1][0], w) for w, q in queues.items()]
    heapq.heapify(heap)
    while heap and not take.full():
        _, _, w = heapq.heappop(heap)
        ref = ShardRef(w, *queues[w].pop())
        if visible is not None and not visible(ref):
            sel.stats["index_missing"] = sel.stats.get("index_missing", 0) + 1
            continue
        if take.shard(ref, group_info) and queues[w]:
            nxt = queues[w][-1]
            heapq.heappush(heap, (nxt[3], nxt[0], w))
    sel.samples = take.total
    if not take.drop:
        sel.stats.pop("stale_dropped_samples")
        sel.stats.pop("stale_dropped_groups")
    if not take.flag:
        sel.stats.pop("stale_flagged_samples")
    return sel


def _writer_queues(rd: RunDir, sel: Selection, extra_refs: Callable[[str, int], ShardRef | None],
                   fresh: bool) -> dict[str, _Queue]:
    """Every writer's shards from its position on (a partly consumed shard moved to quarantine comes first)."""
    queues: dict[str, _Queue] = {}
    for w in sorted(set(list_writers(rd)) | set(sel.writers)):
        seq, g, _ = sel.writers.get(w, _NOTHING)
        found = scan_shards_cached(rd, w, seq, fresh=fresh)
        _queue(queues, w, found, seq, g, extra_refs)
    return queues


def _queue(queues: dict[str, _Queue], w: str, found: _Queue, seq: int, g: int,
           extra_refs: Callable[[str, int], ShardRef | None]) -> None:
    """Writer ``w``'s queue from its shards ``found`` (from its position ``seq`` on, ``g`` groups of it consumed):
    its partly consumed shard, moved to quarantine, first where ``found`` lacks it; the next shard last."""
    if g > 0 and (not found or found[0][0] != seq):
        moved = extra_refs(w, seq)
        if moved is not None:
            found.insert(0, (moved.seq, moved.num_samples, moved.num_groups, moved.min_version, moved.max_version))
    if found:
        found.reverse()  # the next shard is the last item
        queues[w] = found


def _index_queues(rd: RunDir, sel: Selection, index: Announced,
                  extra_refs: Callable[[str, int], ShardRef | None]) -> dict[str, _Queue]:
    """:func:`_writer_queues` from the announced shards: only writers with announcements (or a partly consumed
    shard) are looked at, and one whose announcements leave a gap after its position is listed (the truth)."""
    queues: dict[str, _Queue] = {}
    partial = [w for w, e in sel.writers.items() if e[1] > 0 and w not in index]
    for w in [*index, *partial]:
        seq, g, _ = sel.writers.get(w, _NOTHING)
        found = [t for t in index.get(w, ()) if t[0] >= seq]
        gap = not found or found[0][0] != seq or found[-1][0] - seq != len(found) - 1
        if gap and (found or g > 0):
            sel.stats["index_gaps"] = sel.stats.get("index_gaps", 0) + 1
            found = scan_shards_cached(rd, w, seq, fresh=True)
        _queue(queues, w, found, seq, g, extra_refs)
    return queues


class _Taker:
    """The groups :func:`select` takes, shard by shard, with the stale policy and the limits applied."""

    def __init__(self, sel: Selection, min_version: int | None, stale_policy: StalePolicy, *,
                 max_groups: float, max_samples: float):
        self.sel, self.st = sel, sel.stats
        self.floor = min_version if min_version is not None else -1
        self.drop = stale_policy == "drop" and min_version is not None
        self.flag = stale_policy == "flag" and min_version is not None
        self.max_groups, self.max_samples = max_groups, max_samples
        self.count = self.total = 0

    def full(self) -> bool:
        return self.count >= self.max_groups or self.total >= self.max_samples

    def shard(self, ref: ShardRef, group_info: Callable[[ShardRef], GroupInfo | None]) -> bool:
        """Take what the limits allow of ``ref`` past the writer's position; True if the shard is done with."""
        pos = self.sel.writers.get(ref.writer_id, _NOTHING)
        g_start, s_start = (pos[1], pos[2]) if pos[0] == ref.seq else (0, 0)
        done = True
        if self.drop and ref.max_version < self.floor:  # the whole rest of the shard is stale: no need to open it
            self.st["stale_dropped_samples"] += ref.num_samples - s_start
            self.st["stale_dropped_groups"] += ref.num_groups - g_start
        else:
            info = group_info(ref)
            if info is None:
                self.st["quarantined_shards"].append(ref.rel)
                self.st["quarantined_samples"] += ref.num_samples - s_start
            else:
                g, s = self._groups(ref, info, g_start, s_start)
                if g < ref.num_groups:
                    self.sel.writers[ref.writer_id] = [ref.seq, g, s]
                    done = False
        if done:
            self.sel.writers[ref.writer_id] = [ref.seq + 1, 0, 0]
        return done

    def _groups(self, ref: ShardRef, info: GroupInfo, g: int, s: int) -> tuple[int, int]:
        """Take groups of ``ref`` from group ``g`` (sample ``s``) on; returns the position after the last one seen."""
        idx = -1
        sizes, mins = info.group_sizes, info.group_min_version
        while g < ref.num_groups and not self.full():
            size = sizes[g]
            if self.drop and mins[g] < self.floor:
                self.st["stale_dropped_samples"] += size
                self.st["stale_dropped_groups"] += 1
            else:
                if idx < 0:
                    self.sel.shards.append(ref)
                    idx = len(self.sel.shards) - 1
                self.sel.groups.append((idx, g, size))
                self.count += 1
                self.total += size
                if self.flag and mins[g] < self.floor:
                    self.st["stale_flagged_samples"] += sum(v < self.floor for v in info.sample_versions[g])
            g += 1
            s += size
        return g, s


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
