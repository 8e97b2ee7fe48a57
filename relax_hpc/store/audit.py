"""The store's accounting after a run: every group a writer published is consumed once, dropped as stale,
quarantined, or still unread past the final position; none is lost or consumed twice.

The proof follows what the trainer committed, not what it says about itself:

1. The final committed position (``position.json``) is the end of a *chain* of batch plans: each plan's
   ``position_after`` is the committed (or next plan's) position and its ``position_before`` the previous plan's
   ``position_after``, back to the empty position. The chain is walked backwards through the plan files (so the run
   must keep them: ``store.keep_plans``), and must be unbroken.
2. Each plan moves the position past a range of groups (its *delta*). The groups its ranks read must lie in that
   range; the rest of the range must be exactly its stale-dropped groups (as many as its stats say) and groups of
   quarantined shards. Ranges of successive plans are disjoint when positions only move forward.
3. Every published group (``samples/shards`` and ``samples/quarantine``; the run must keep consumed shards:
   ``store.retention: keep``) is then in one of: consumed, dropped, quarantined, unread (at or past the final
   position), or *lost* (below it, yet in no plan's range). *Duplicated* counts groups read by more than one plan
   of the chain.

``relax-hpc bench chaos`` runs this on every run it kills. Samples are counted per group from the shard names
(``.s<N>.g<G>``: ``N / G`` samples a group, exact for groups of equal size).
"""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from relax_hpc.errors import StoreError
from relax_hpc.fsio import read_json
from relax_hpc.rundir import RunDir
from relax_hpc.store.layout import SHARD_RE, ShardRef, list_shards, list_writers, read_position

Group = tuple[str, int, int]
"""(writer id, shard seq, group index)."""


@dataclass
class StoreAudit:
    """The accounting of one consumer over one run dir, in groups and samples (module docstring)."""

    plans: int = 0
    produced_groups: int = 0
    consumed_groups: int = 0
    dropped_groups: int = 0
    quarantined_groups: int = 0
    unread_groups: int = 0
    duplicated_groups: int = 0
    lost_groups: int = 0
    produced: int = 0
    consumed: int = 0
    dropped: int = 0
    quarantined: int = 0
    unread: int = 0
    duplicated: int = 0
    lost: int = 0
    problems: list[str] = field(default_factory=list)
    """What could not be proved (a broken plan chain, a plan reading outside its range ...): empty when sound."""

    @property
    def balanced(self) -> bool:
        """Produced = consumed + dropped + quarantined + unread, nothing lost or read twice, no problem."""
        return (not self.problems and self.lost_groups == 0 and self.duplicated_groups == 0
                and self.produced_groups == self.consumed_groups - self.duplicated_groups + self.dropped_groups
                + self.quarantined_groups + self.unread_groups)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "balanced": self.balanced}


class _Inventory:
    """Every published shard: (writer, seq) -> (groups, samples), and which ones are in quarantine."""

    def __init__(self, rd: RunDir):
        self.shards: dict[tuple[str, int], tuple[int, int]] = {}
        self.quarantined: set[tuple[str, int]] = set()
        for writer in list_writers(rd):
            for ref in list_shards(rd, writer):
                self.shards[(writer, ref.seq)] = (ref.num_groups, ref.num_samples)
        for path in sorted(rd.quarantine.glob("*.h5")) if rd.quarantine.is_dir() else []:
            moved = _quarantined_ref(path.name)
            if moved is not None:
                self.shards.setdefault((moved.writer_id, moved.seq), (moved.num_groups, moved.num_samples))
                self.quarantined.add((moved.writer_id, moved.seq))

    def groups(self, writer: str, seq: int) -> int | None:
        got = self.shards.get((writer, seq))
        return None if got is None else got[0]

    def group_samples(self, writer: str, seq: int) -> int:
        groups, samples = self.shards.get((writer, seq), (1, 0))
        return samples // max(1, groups)

    def every_group(self) -> list[Group]:
        return [(w, s, g) for (w, s), (n, _) in sorted(self.shards.items()) for g in range(n)]


def _quarantined_ref(name: str) -> ShardRef | None:
    """``<writer>.<shard name>`` of a quarantined shard."""
    for i, ch in enumerate(name):
        if ch == "." and SHARD_RE.match(name[i + 1:]):
            return ShardRef.parse(name[:i], name[i + 1:])
    return None


def _delta(before: dict[str, Any], after: dict[str, Any], inv: _Inventory, problems: list[str]) -> list[Group]:
    """The groups a plan moved the position past (from ``before`` to ``after``)."""
    out: list[Group] = []
    for writer, (seq_a, g_a, _) in after["writers"].items():
        seq, g = before["writers"].get(writer, [0, 0, 0])[:2]
        if (seq_a, g_a) < (seq, g):
            problems.append(f"writer {writer}: the position moved back from {[seq, g]} to {[seq_a, g_a]}")
            continue
        while (seq, g) < (seq_a, g_a):
            n = inv.groups(writer, seq)
            if n is None:
                problems.append(f"shard {seq} of writer {writer} is below a position but not on disk "
                                "(was store.retention delete?)")
                break
            end = n if seq < seq_a else g_a
            out += [(writer, seq, k) for k in range(g, end)]
            seq, g = (seq + 1, 0) if seq < seq_a else (seq, end)
    return out


def _read_groups(plan: dict[str, Any]) -> list[Group]:
    """The groups a plan hands to its ranks."""
    refs = [ShardRef.from_rel(s) for s in plan["shards"]]
    return [(refs[i].writer_id, refs[i].seq, k) for runs in plan["ranks"] for i, g0, g1 in runs for k in range(g0, g1)]


def _chain(rd: RunDir, consumer: str, final: dict[str, Any], problems: list[str]) -> list[dict[str, Any]]:
    """The plans from the empty position to ``final``, oldest first."""
    chain: list[dict[str, Any]] = []
    cur = final
    while cur["writers"]:
        step = cur.get("step")
        path = rd.consumer_plan(int(step), consumer) if isinstance(step, int) else None
        try:
            plan = read_json(path, default=None, expect=dict) if path is not None else None
        except (OSError, ValueError) as exc:
            problems.append(f"plan {path} is unreadable: {exc}")
            break
        if plan is None or plan.get("position_after", {}).get("writers") != cur["writers"]:
            what = "missing (was store.keep_plans too small?)" if plan is None else "not the one that ends there"
            problems.append(f"the plan chain breaks at position step {step}: the plan is {what}")
            break
        chain.append(plan)
        cur = plan["position_before"]
    return chain[::-1]


def audit(run_dir: RunDir | Path | str, consumer: str = "trainer") -> StoreAudit:
    """The accounting of ``consumer`` in ``run_dir`` (module docstring)."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    out = StoreAudit()
    try:
        final = read_position(rd.consumer_position(consumer), consumer)
    except StoreError as exc:
        out.problems.append(str(exc))
        return out
    inv = _Inventory(rd)
    final = final or {"writers": {}}
    chain = _chain(rd, consumer, final, out.problems)
    out.plans = len(chain)
    covered: collections.Counter[Group] = collections.Counter()
    read: collections.Counter[Group] = collections.Counter()
    kinds: dict[Group, str] = {}
    for plan in chain:
        delta = _delta(plan["position_before"], plan["position_after"], inv, out.problems)
        mine = _read_groups(plan)
        covered.update(delta)
        read.update(mine)
        in_range = set(delta)
        if not set(mine) <= in_range:
            out.problems.append(f"plan {plan['step']} reads groups outside the range it moves past")
        rest = [gr for gr in delta if gr not in set(mine)]
        quarantined = [gr for gr in rest if gr[:2] in inv.quarantined]
        dropped = [gr for gr in rest if gr[:2] not in inv.quarantined]
        want = int(plan.get("stats", {}).get("stale_dropped_groups", 0))
        if len(dropped) != want:
            out.problems.append(f"plan {plan['step']} moves past {len(dropped)} groups it neither reads nor "
                                f"quarantines, but drops {want} as stale")
        kinds.update({gr: "quarantined" for gr in quarantined})
        kinds.update({gr: "dropped" for gr in dropped})
        kinds.update({gr: "consumed" for gr in mine})
    _tally(out, inv, final, covered, read, kinds)
    return out


def _tally(out: StoreAudit, inv: _Inventory, final: dict[str, Any], covered: collections.Counter[Group],
           read: collections.Counter[Group], kinds: dict[Group, str]) -> None:
    for gr, n in covered.items():
        if n > 1:
            out.problems.append(f"group {gr} lies in the ranges of {n} plans")
            break
    for (w, s, _g), n in read.items():
        size = inv.group_samples(w, s)
        out.consumed_groups += n
        out.consumed += n * size
        out.duplicated_groups += n - 1
        out.duplicated += (n - 1) * size
    for w, s, g in inv.every_group():
        size = inv.group_samples(w, s)
        out.produced_groups += 1
        out.produced += size
        kind = kinds.get((w, s, g))
        if kind is None:
            seq, first = final["writers"].get(w, [0, 0, 0])[:2]
            kind = "unread" if (s, g) >= (seq, first) else "lost"
        if kind != "consumed":
            setattr(out, f"{kind}_groups", getattr(out, f"{kind}_groups") + 1)
            setattr(out, kind, getattr(out, kind) + size)
