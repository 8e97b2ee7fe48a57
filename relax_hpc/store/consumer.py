"""Consumer groups: exactly-once reading of the sample store by the ranks of one trainer, without locks.

Protocol (``docs/protocol-samples.md``):

* The leader (rank 0) plans each step from the current position and writes the plan atomically to
  ``consumers/<name>/plans/step_NNNNNNNN.json`` (``position_before`` and ``position_after`` inside); every rank reads
  its own part of it. A plan file, once written, is final: a leader that restarts from checkpoint ``k`` replays the
  plans it finds for steps ``> k`` whose ``position_before`` continues its chain, and rewrites any other. Ranks accept
  a plan only if its ``position_before`` equals the position they are at, so a stale plan is never read.
* ``position_after(step)`` goes into the trainer's checkpoint; once the checkpoint is durable the leader calls
  :meth:`ConsumerGroup.commit`, which writes ``consumers/<name>/position.json`` and only then applies retention to
  shards below it. A trainer resumed from checkpoint ``k`` calls :meth:`ConsumerGroup.resume` with the position
  stored there: nothing is skipped or read twice.
* ``consumers/<name>/planned.json`` gives the latest planned position, for writers' backlog figures: a small
  position file replaced at every plan (the plan's ``position_after``) and by :meth:`ConsumerGroup.resume`.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import itertools
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np

from relax_hpc.errors import CorruptShardError, RunDirError, StoreError, UserError, WaitTimeout
from relax_hpc.fsio import atomic_write_json, read_json, refresh_nfs_cache, remove_debris, wait_for
from relax_hpc.rundir import RunDir
from relax_hpc.store.announce import list_announced, read_heads, remove_consumed
from relax_hpc.store.layout import (
    ShardRef,
    check_consumer,
    check_position,
    empty_position,
    quarantine,
    read_position,
    resolve,
)
from relax_hpc.store.plan import GroupInfo, Plan, StalePolicy, select, split_ranks
from relax_hpc.store.retention import delete_consumed, prune_plans
from relax_hpc.store.sample import Sample
from relax_hpc.store.shard_reader import (
    ShardHeader,
    load_small,
    open_shard,
    read_columns,
    read_groups,
    read_header,
)
from relax_hpc.store.writer import describe_oserror, open_run_dir

log = logging.getLogger("relax_hpc.store")
Retention = Literal["delete", "keep"]
#: Shards with at most this many data bytes are read whole when the leader plans them (one open for plan and read).
SMALL_SHARD_BYTES = 4 << 20
#: A plan whose look at the announcement index finds too little data lists every writer folder, unless the last
#: such full scan is younger than this (a plan waiting for data polls; seconds).
SHORT_RESCAN_S = 1.0


class ConsumerGroup:
    """One rank of a consumer group (``name``, default ``"trainer"``) reading the sample store.

    ``rank``/``world_size`` are the *data-parallel* rank and size: a plan splits a step's groups into
    ``world_size`` parts and this object reads part ``rank``. With model parallelism several trainer processes share
    a data-parallel rank (and read the same part); exactly one of them, the ``leader`` (default: ``rank == 0``),
    plans (:meth:`plan`), commits (:meth:`commit`) and applies retention; the others wait for plans
    (:meth:`wait_plan`). Every process reads its part with :meth:`read`. The initial position is the committed one;
    a trainer restored from a checkpoint calls :meth:`resume` on every rank before the first plan.

    The leader reads the data of a shard it plans together with its header when the shard holds at most
    ``SMALL_SHARD_BYTES`` (no big tensors), and keeps it (at most ``data_cache_bytes`` in all; 0: never) until its
    groups are read: :meth:`read` then verifies the checksums of those groups without opening the file again.
    """

    def __init__(
        self,
        run_dir: RunDir | Path | str,
        name: str = "trainer",
        rank: int = 0,
        world_size: int = 1,
        *,
        retention: Retention = "delete",
        keep_plans: int = 16,
        debris_age_s: float = 3600.0,
        full_scan_s: float = 10.0,
        header_cache: int = 1024,
        data_cache_bytes: int = 64 << 20,
        leader: bool | None = None,
    ):
        if not 0 <= rank < world_size:
            raise UserError(f"rank must be in [0, {world_size}), got {rank}")
        if leader and rank != 0:
            raise UserError(f"the leader plans for every data-parallel rank and reads part 0, not {rank}")
        self._leader = rank == 0 if leader is None else leader
        if retention not in ("delete", "keep"):
            raise UserError(f"retention must be 'delete' or 'keep', got {retention!r}")
        self.run_dir = open_run_dir(run_dir)
        self.name = check_consumer(name)
        self.rank, self.world_size = rank, world_size
        self.retention: Retention = retention
        self.keep_plans = keep_plans
        self.debris_age_s = debris_age_s
        #: The planner lists every writer folder at least this often (seconds); in between it reads the index.
        self.full_scan_s = full_scan_s
        self._last_full = -math.inf
        self._retired: dict[str, int] = {}
        self._cache: collections.OrderedDict[tuple[str, int], tuple[ShardHeader, GroupInfo]] = collections.OrderedDict()
        self._cache_size = header_cache
        self._data: collections.OrderedDict[tuple[str, int], dict[str, np.ndarray]] = collections.OrderedDict()
        self._data_size: dict[tuple[str, int], int] = {}
        self._data_bytes = 0
        self.data_cache_bytes = data_cache_bytes
        self._plans: dict[int, Plan] = {}
        self._planned = self.run_dir.consumer_planned(self.name)
        #: Counters over this object's life: quarantined_shards/_samples, stale_dropped_samples, samples_read ...
        self.counters: collections.Counter[str] = collections.Counter()
        self._bad: set[tuple[str, int]] = set()
        if self.is_leader:
            folder = self.run_dir.consumer_plans(self.name)
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise RunDirError(f"cannot create {folder}: {describe_oserror(exc)}") from exc
        #: Why the committed position file could not be read (None: it could, or there is none yet). A trainer
        #: resuming from a checkpoint uses the checkpoint's copy of the position instead (:meth:`resume`).
        self.position_problem: str | None = None
        try:
            committed = read_position(self.run_dir.consumer_position(self.name), self.name)
        except StoreError as exc:
            self.position_problem, committed = str(exc), None
            log.warning("%s; the position stored in the checkpoint will be used", exc)
        self._set_base(committed or empty_position(self.name))

    @property
    def is_leader(self) -> bool:
        """This process plans and commits (one per consumer group)."""
        return self._leader

    @property
    def position(self) -> dict[str, Any]:
        """The position after the last plan this rank planned or accepted (or the resumed/committed one)."""
        return copy.deepcopy(self._base)

    def _set_base(self, position: dict[str, Any]) -> None:
        self._base = position
        step = position.get("step")
        self._last_step = step if isinstance(step, int) else -1

    # ------------------------------------------------------------------------------------------------- planning
    def plan(
        self,
        step: int,
        num_samples: int | None = None,
        *,
        num_groups: int | None = None,
        min_version: int | None = None,
        stale_policy: StalePolicy = "drop",
        timeout_s: float = 600.0,
        wait: bool = True,
    ) -> Plan:
        """(Leader) Plan ``step``: whole groups until ``num_samples`` samples (>=, by whole groups) or exactly
        ``num_groups`` groups, of policy version >= ``min_version`` (older ones dropped, or kept with ``stale``
        set: ``stale_policy``). Waits up to ``timeout_s`` for enough data (:class:`WaitTimeout`); with
        ``wait=False`` returns what is available now, possibly less or nothing (streaming: plan the next
        micro-batch as a further step). A plan already on disk for ``step`` that continues this chain is replayed.
        """
        if not self.is_leader:
            raise StoreError(f"only rank 0 plans (the leader); rank {self.rank} calls wait_plan({step})")
        if (num_samples is None) == (num_groups is None):
            raise UserError("give exactly one of num_samples and num_groups")
        if (num_samples or num_groups or 0) < 1:
            raise UserError("num_samples / num_groups must be >= 1")
        if stale_policy not in ("drop", "flag"):
            raise UserError(f"stale_policy must be 'drop' or 'flag', got {stale_policy!r}")
        if step <= self._last_step:
            raise StoreError(
                f"step {step} is not after the last planned step {self._last_step} of consumer {self.name!r}"
            )
        path = self.run_dir.consumer_plan(step, self.name)
        existing = self._load_plan(path)
        if existing is not None:
            log.info("replaying plan %s written before a restart (%d samples)", path, existing.num_samples)
            self._publish_planned(existing.position_after)
            return self._accept(existing)
        found: list[Any] = []

        def attempt() -> Any:
            sel = self._select(num_samples, num_groups, min_version, stale_policy, wait=wait)
            found[:] = [sel]
            return sel if self._enough(sel, num_samples, num_groups) or not wait else None

        want = f"{num_groups} groups" if num_groups is not None else f"{num_samples} samples"
        try:
            sel = (
                attempt()
                if not wait
                else wait_for(
                    attempt, what=f"{want} for step {step} of consumer {self.name!r}", timeout_s=timeout_s, logger=log
                )
            )
        except WaitTimeout:
            have = found[0].samples if found else 0
            raise WaitTimeout(
                f"timed out after {timeout_s:.0f}s waiting for {want} for step {step} of consumer "
                f"{self.name!r} (only {have} samples available)"
            ) from None
        ranks, counts = split_ranks(sel.groups, self.world_size)
        after = {"format": 1, "consumer": self.name, "step": step, "writers": sel.writers}
        plan = Plan(
            step=step,
            consumer=self.name,
            world_size=self.world_size,
            shards=[r.rel for r in sel.shards],
            ranks=ranks,
            rank_samples=counts,
            position_before=self._base,
            position_after=after,
            min_version=min_version,
            stale_policy=stale_policy,
            stats={"samples": sel.samples, "groups": len(sel.groups), **sel.stats},
        )
        atomic_write_json(path, plan.to_json(), fsync=False, indent=None)  # not durable: see _load_plan
        self._publish_planned(after)
        for key in ("stale_dropped_samples", "stale_flagged_samples", "quarantined_samples"):
            self.counters[key] += int(sel.stats.get(key, 0))
        self.counters["quarantined_shards"] += len(sel.stats["quarantined_shards"])
        return self._accept(plan)

    @staticmethod
    def _enough(sel: Any, num_samples: int | None, num_groups: int | None) -> bool:
        return len(sel.groups) >= num_groups if num_groups is not None else sel.samples >= (num_samples or 0)

    def _select(self, num_samples: int | None, num_groups: int | None, min_version: int | None,
                stale_policy: StalePolicy, *, wait: bool) -> Any:
        """One look for the groups of a plan: from the announcement index, or (the first plan, every
        ``full_scan_s``, a damaged index) from a listing of every writer folder. A look at the index that finds too
        little data for a plan that waits (nothing, for a plan that takes what there is: streaming plans are short
        by design), or an announced shard that is not visible, lists every folder at once unless that was done less
        than ``SHORT_RESCAN_S`` ago (a lost announcement or an attribute cache never hides data for longer)."""
        now = time.monotonic()
        args: dict[str, Any] = {"num_samples": num_samples, "num_groups": num_groups, "min_version": min_version,
                                "stale_policy": stale_policy, "group_info": self._group_info,
                                "extra_refs": self._quarantined_ref}
        if now - self._last_full < self.full_scan_s:
            index, damaged = list_announced(self.run_dir)
            index = read_heads(self.run_dir, {*self._base["writers"], *index}, index)
            self.counters["index_damaged"] += damaged
            if not damaged:
                sel = select(self.run_dir, self._base["writers"], index=index, visible=self._visible, **args)
                self.counters["index_plans"] += 1
                self.counters["index_gaps"] += sel.stats.pop("index_gaps", 0)
                missing = sel.stats.pop("index_missing", 0)
                self.counters["index_missing"] += missing
                enough = not missing and (self._enough(sel, num_samples, num_groups) if wait else bool(sel.groups))
                if enough or now - self._last_full < SHORT_RESCAN_S:
                    return sel
        self._last_full = now
        self.counters["full_scans"] += 1
        return select(self.run_dir, self._base["writers"], fresh_listing=True, **args)

    def _visible(self, ref: ShardRef) -> bool:
        return resolve(self.run_dir, ref) is not None

    def _publish_planned(self, position: dict[str, Any]) -> None:
        """Make ``planned.json`` give ``position``: a small file replaced by rename (no fsync). Not a symbolic link
        to the plan file, though that would rename no data: a network client resolves a replaced link through its
        cached entry for a whole entry-cache timeout (30.8 s on sshfs with 30 s caches, docs/netfs.md), so writers
        would pause for room that was already made; a replaced file is read fresh by name (close-to-open)."""
        atomic_write_json(self._planned, position, fsync=False, indent=None)

    def plan_available(self, step: int, num_samples: int | None = None, **kwargs: Any) -> Plan:
        """(Leader) :meth:`plan` without waiting: up to ``num_samples`` of what is published now (maybe none)."""
        return self.plan(step, num_samples, wait=False, **kwargs)

    def wait_plan(self, step: int, timeout_s: float = 600.0) -> Plan:
        """(Any rank) Wait for the leader's plan of ``step`` that continues this rank's position, and accept it."""
        if step in self._plans:
            return self._plans[step]
        path = self.run_dir.consumer_plan(step, self.name)

        def ready() -> Plan | None:
            refresh_nfs_cache(path)
            return self._load_plan(path)

        return self._accept(wait_for(ready, what=f"plan {path}", timeout_s=timeout_s, logger=log))

    def _load_plan(self, path: Path) -> Plan | None:
        """The plan at ``path`` if it continues this rank's position. Plan files are written without fsync: after a
        crash of the machine one may be missing or torn (unreadable), and is then planned again; only the position
        in a checkpoint and the committed position are durable."""
        try:
            data = read_json(path, default=None)
        except (OSError, ValueError):
            return None
        if data is None or data.get("position_before", {}).get("writers") != self._base["writers"]:
            return None  # absent, or a plan of an abandoned chain (before a restart from an older checkpoint)
        if data.get("world_size") != self.world_size:
            return None  # planned for another data-parallel size: the leader re-plans it
        return Plan.from_json(data)

    def _accept(self, plan: Plan) -> Plan:
        self._plans[plan.step] = plan
        while len(self._plans) > 64:
            self._plans.pop(min(self._plans))
        self._set_base(check_position(plan.position_after, self.name))
        if self._data:
            self._drop_data(plan.position_before["writers"])
        return plan

    def _drop_data(self, writers: dict[str, list[int]]) -> None:
        """Forget the data of shards below the position ``writers`` (consumed)."""
        for key in [k for k in self._data if k[1] < writers.get(k[0], (0,))[0]]:
            self._forget_data(key)

    def _forget_data(self, key: tuple[str, int]) -> None:
        if self._data.pop(key, None) is not None:
            self._data_bytes -= self._data_size.pop(key)

    def _keep_data(self, key: tuple[str, int], columns: dict[str, np.ndarray], nbytes: int) -> None:
        self._forget_data(key)
        self._data[key] = columns
        self._data_size[key] = nbytes
        self._data_bytes += nbytes
        while self._data_bytes > self.data_cache_bytes and self._data:
            self._forget_data(next(iter(self._data)))

    def position_after(self, step: int) -> dict[str, Any]:
        """The position after ``step``'s plan, to store in the trainer's checkpoint (JSON-able)."""
        plan = self._plans.get(step) or self._plan_from_disk(step)
        return copy.deepcopy(plan.position_after)

    def _plan_from_disk(self, step: int) -> Plan:
        path = self.run_dir.consumer_plan(step, self.name)
        try:
            return Plan.from_json(read_json(path))
        except FileNotFoundError:
            raise StoreError(f"no plan for step {step} of consumer {self.name!r} ({path})") from None

    # --------------------------------------------------------------------------------------------------- reading
    def _group_info(self, ref: ShardRef) -> GroupInfo | None:
        key = (ref.writer_id, ref.seq)
        if key in self._bad:
            return None
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached[1]
        path = resolve(self.run_dir, ref)
        if path is None:
            return None
        try:
            header = self._plan_header(path, key)
            if (header.num_samples, header.num_groups) != (ref.num_samples, ref.num_groups):
                raise CorruptShardError(
                    f"{path}: header says {header.num_samples} samples in {header.num_groups} "
                    f"groups, the file name {ref.num_samples} in {ref.num_groups}"
                )
        except (CorruptShardError, FileNotFoundError) as exc:
            self._forget_data(key)
            self._bad.add(key)
            quarantine(self.run_dir, ref, str(exc), detected_by=f"{self.name}-{self.rank} (plan)")
            return None
        goff = header.sample_lists[0]
        versions = header.versions.tolist()
        per_group = [versions[a:b] for a, b in itertools.pairwise(goff)]
        mins = np.minimum.reduceat(header.versions, goff[:-1]).tolist()  # groups are never empty
        info = GroupInfo(np.diff(header.group_offsets).tolist(), mins, per_group)
        self._cache[key] = (header, info)
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return info

    def _plan_header(self, path: Path, key: tuple[str, int]) -> ShardHeader:
        """The verified header of a shard being planned. The data of a small shard is read in the same go and kept
        for :meth:`read` (a problem with it is left to :meth:`read`, which reads the file again and names it)."""
        budget = min(SMALL_SHARD_BYTES, self.data_cache_bytes)
        loaded = load_small(path, SMALL_SHARD_BYTES)
        if loaded is not None:
            if loaded.nbytes <= budget:
                self._keep_data(key, loaded.columns, loaded.nbytes)
            return loaded.header
        with open_shard(path) as f:
            header = read_header(f, path)
            nbytes = header.data_bytes()
            if nbytes is not None and nbytes <= budget:
                with contextlib.suppress(CorruptShardError):
                    self._keep_data(key, read_columns(f, header, path), nbytes)
        return header

    def _quarantined_ref(self, writer_id: str, seq: int) -> ShardRef | None:
        prefix = f"{writer_id}.{seq:012d}."
        try:
            names = [n for n in os.listdir(self.run_dir.quarantine) if n.startswith(prefix) and n.endswith(".h5")]
        except FileNotFoundError:
            return None
        return ShardRef.parse(writer_id, names[0][len(writer_id) + 1 :]) if names else None

    def read(self, plan: Plan) -> list[Sample]:
        """This rank's samples of ``plan``, group by group in plan order, verified.

        A shard that fails verification is quarantined (one warning), its bad groups are skipped and counted in
        :attr:`counters` (``quarantined_samples``); the reader carries on. Samples below the plan's
        ``min_version`` come back with ``stale=True`` when the plan's policy is ``"flag"``.
        """
        out: list[Sample] = []
        runs = plan.ranks[self.rank] if self.rank < len(plan.ranks) else []
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for shard_idx, g0, g1 in runs:
            by_shard.setdefault(shard_idx, []).append((g0, g1))
        after = plan.position_after["writers"]
        for shard_idx, group_runs in by_shard.items():
            ref = ShardRef.from_rel(plan.shards[shard_idx])
            out.extend(self._read_shard_runs(ref, group_runs))
            if ref.seq < after.get(ref.writer_id, (0,))[0]:
                self._forget_data((ref.writer_id, ref.seq))
        if plan.min_version is not None and plan.stale_policy == "flag":
            for s in out:
                s.stale = s.version < plan.min_version
        self.counters["samples_read"] += len(out)
        return out

    def _read_shard_runs(self, ref: ShardRef, group_runs: list[tuple[int, int]]) -> list[Sample]:
        path = resolve(self.run_dir, ref)
        if path is None:
            lost = sum(g1 - g0 for g0, g1 in group_runs)
            log.warning(
                "shard %s of the plan is gone (deleted by retention of a newer commit?); skipping %d groups",
                ref.rel,
                lost,
            )
            self.counters["missing_groups"] += lost
            return []
        key = (ref.writer_id, ref.seq)
        cached = self._cache.get(key)  # verified when this process planned it
        header = cached[0] if cached is not None else None
        columns = self._data.get(key) if cached is not None else None
        if columns is None and (loaded := load_small(path, SMALL_SHARD_BYTES)) is not None:
            header, columns = loaded.header, loaded.columns
        if columns is not None and header is not None:  # the shard is in memory: no second open, no HDF5 library
            got = _read_runs(None, header, path, group_runs, columns)
            if not got.problem:
                return got.samples
        got = self._read_file(path, ref, header, group_runs)  # the library also names (or clears) any problem
        if got.lost_groups:
            self._count_lost(ref, got.lost_groups)
        if got.bad_groups:
            self.counters["quarantined_groups"] += got.bad_groups
            self.counters["quarantined_samples"] += got.bad_samples
        if got.problem:
            self.counters["quarantined_shards"] += 1
            quarantine(self.run_dir, ref, got.problem, detected_by=f"{self.name}-{self.rank}")
        return got.samples

    def _read_file(
        self, path: Path, ref: ShardRef, header: ShardHeader | None, group_runs: list[tuple[int, int]]
    ) -> _RunsRead:
        try:
            try:
                f = open_shard(path)
            except FileNotFoundError:  # moved to quarantine by another rank just now
                path = resolve(self.run_dir, ref) or path
                f = open_shard(path)
            with f:
                return _read_runs(f, header if header is not None else read_header(f, path), path, group_runs, None)
        except (CorruptShardError, FileNotFoundError) as exc:  # does not open, or its header is damaged
            return _RunsRead(problem=str(exc), lost_groups=sum(g1 - g0 for g0, g1 in group_runs))

    def _count_lost(self, ref: ShardRef, groups: int) -> None:
        """Count groups lost to a damaged shard (samples estimated from the name when the header is unreadable)."""
        self.counters["quarantined_groups"] += groups
        self.counters["quarantined_samples"] += round(groups * ref.num_samples / max(1, ref.num_groups))

    # -------------------------------------------------------------------------------------- commit and retention
    def commit(self, position: dict[str, Any]) -> None:
        """(Leader; a no-op on other ranks) Record ``position`` (from :meth:`position_after`, stored in a durable
        checkpoint) as committed, then apply retention to the shards below it and clean temp debris."""
        if not self.is_leader:
            return
        position = check_position(position, self.name)
        atomic_write_json(self.run_dir.consumer_position(self.name), position)
        if self.retention == "delete":
            self.counters["shards_retired"] += delete_consumed(self.run_dir, position, self._retired)
        self.counters["announcements_retired"] += remove_consumed(self.run_dir, position)  # kept shards too
        step = position.get("step")
        if isinstance(step, int):
            prune_plans(self.run_dir, self.name, step - self.keep_plans)
        remove_debris(self.run_dir.samples_tmp, older_than_s=self.debris_age_s)

    def resume(self, position: dict[str, Any] | None = None) -> None:
        """Continue from ``position`` (from a checkpoint) or, if None, from the committed position.

        Plans for later steps are replayed if they continue from it, otherwise re-planned.
        """
        if position is None:
            position = read_position(self.run_dir.consumer_position(self.name), self.name)  # raises if damaged
        self._plans.clear()
        for key in list(self._data):
            self._forget_data(key)
        self._set_base(check_position(position, self.name) if position else empty_position(self.name))
        if self.is_leader:
            self._publish_planned(self._base)


@dataclasses.dataclass
class _RunsRead:
    """What reading some runs of groups of one shard gave."""

    samples: list[Sample] = dataclasses.field(default_factory=list)
    problem: str = ""
    lost_groups: int = 0
    """Groups not read because the data was unreadable."""
    bad_groups: int = 0
    bad_samples: int = 0


def _read_runs(
    f: Any, header: ShardHeader, path: Path, group_runs: list[tuple[int, int]], columns: dict[str, np.ndarray] | None
) -> _RunsRead:
    """The verified samples of ``group_runs`` of an open shard ``f`` (or of its ``columns``)."""
    out = _RunsRead()
    bad: list[int] = []
    for i, (g0, g1) in enumerate(group_runs):
        try:
            res = read_groups(f, header, path, g0, g1, columns=columns)
        except CorruptShardError as exc:  # data unreadable: every group of the remaining runs is lost
            out.problem, out.lost_groups = str(exc), sum(b - a for a, b in group_runs[i:])
            break
        out.samples.extend(res.samples)
        bad += res.bad_groups
        out.bad_samples += res.bad_samples
    if bad:
        out.bad_groups = len(bad)
        out.problem = out.problem or f"{path}: checksum mismatch in group(s) {bad}"
    return out
