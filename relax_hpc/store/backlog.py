"""Backlog figures from a directory listing and one small position file: what writers use for admission control.

The listing is the announcement index (``samples/announce``, one folder whatever the number of writers); every
``FULL_LISTING_S`` seconds, and whenever the index is missing or holds a damaged name, every writer folder is listed
instead (a shard published without its announcement is counted within that time). A network client's directory
cache can hide new entries of either listing for a whole timeout, so the heads of the writers known (each names its
newest shards, read by name: close-to-open) are added, read again at most every ``HEADS_REREAD_S``. The figures
steer admission control and the trainer's wait; the plan itself never relies on them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from relax_hpc.errors import StoreError
from relax_hpc.rundir import RunDir
from relax_hpc.store.announce import Announced, list_announced, read_heads
from relax_hpc.store.layout import (
    check_consumer,
    empty_position,
    list_writers,
    read_planned,
    read_position,
    scan_shards,
)
from relax_hpc.store.writer import open_run_dir

_NOTHING = (0, 0, 0)
FULL_LISTING_S = 5.0
"""A process lists every writer folder for the backlog at least this often (seconds); the index in between."""
_last_full: dict[Path, float] = {}
HEADS_REREAD_S = 0.5
"""A process reads the writers' heads for the backlog at most this often (seconds): a shard a directory cache hides
is counted within this time, at one small read per writer each time."""
_heads: dict[Path, tuple[float, Announced]] = {}


def _listing(rd: RunDir, done: dict[str, list[int]]) -> Announced:
    """Each writer's shards past ``done``: from the index, or from every writer folder, and the writers' heads
    (module docstring)."""
    now = time.monotonic()
    found: Announced | None = None
    if now - _last_full.get(rd.root, -FULL_LISTING_S) < FULL_LISTING_S:
        index, damaged = list_announced(rd)
        if not damaged:
            found = index
    if found is None:
        if len(_last_full) > 256:
            _last_full.clear()
        _last_full[rd.root] = now
        found = {w: scan_shards(rd, w, done.get(w, _NOTHING)[0]) for w in list_writers(rd)}
    found = _with_heads(rd, {*done, *found}, found, now)
    return {w: [t for t in got if t[0] >= done.get(w, _NOTHING)[0]] for w, got in found.items()}


def _with_heads(rd: RunDir, writers: set[str], found: Announced, now: float) -> Announced:
    """``found`` plus the shards the heads of ``writers`` name (read again at most every ``HEADS_REREAD_S``)."""
    when, heads = _heads.get(rd.root, (-HEADS_REREAD_S, {}))
    if now - when >= HEADS_REREAD_S or not writers <= set(heads):
        if len(_heads) > 256:
            _heads.clear()
        heads = read_heads(rd, writers, {w: [] for w in writers})
        _heads[rd.root] = (now, heads)
    out = {w: list(v) for w, v in found.items()}
    for w, named in heads.items():
        have = {t[0] for t in out.get(w, ())}
        extra = [t for t in named if t[0] not in have]
        if extra:
            out[w] = sorted([*out.get(w, []), *extra])
    return out


@dataclass(frozen=True)
class BacklogInfo:
    """Published but not yet planned data of one consumer group.

    Counts come from shard file names; a partly consumed shard counts only its remaining groups and samples.
    ``samples_by_version`` keys each shard's remaining samples by the shard's *minimum* version.
    """

    samples: int
    groups: int
    shards: int
    writers: int
    min_version: int | None
    max_version: int | None
    samples_by_version: dict[int, int] = field(default_factory=dict)
    position_step: int | None = None
    """The step of the plan the figures are relative to (None: nothing planned yet)."""
    time: float = 0.0

    def batches_ahead(self, batch_size: int) -> float:
        """How many batches of ``batch_size`` samples are waiting (a rollout worker pauses above its limit)."""
        return self.samples / max(1, batch_size)


def backlog(run_dir: RunDir | Path | str, consumer: str = "trainer") -> BacklogInfo:
    """Unconsumed samples of ``consumer``: relative to its latest planned position (else the committed one)."""
    rd = open_run_dir(run_dir)
    check_consumer(consumer)
    position = read_planned(rd.consumer_planned(consumer), consumer)
    if position is None:
        try:
            position = read_position(rd.consumer_position(consumer), consumer)
        except StoreError:  # damaged: the trainer rewrites it at its next checkpoint; count from the start now
            position = None
    position = position or empty_position(consumer)
    samples = groups = shards = 0
    writers_with_data = 0
    vmin: int | None = None
    vmax: int | None = None
    by_version: dict[int, int] = {}
    done = position["writers"]
    for w, found in _listing(rd, done).items():
        seq, g_done, s_done = done.get(w, _NOTHING)
        if not found:
            continue
        writers_with_data += 1
        shards += len(found)
        for q, n, g, lo, hi in found:
            if q == seq:
                g, n = g - g_done, n - s_done
            samples += n
            groups += g
            by_version[lo] = by_version[lo] + n if lo in by_version else n
            if vmin is None or lo < vmin:
                vmin = lo
            if vmax is None or hi > vmax:
                vmax = hi
    return BacklogInfo(
        samples,
        groups,
        shards,
        writers_with_data,
        vmin,
        vmax,
        dict(sorted(by_version.items())),
        position.get("step"),
        time.time(),
    )
