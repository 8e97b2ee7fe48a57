"""Backlog figures from a directory listing and one small position file: what writers use for admission control.

The listing is the announcement index (``samples/announce``, one folder whatever the number of writers); every
``FULL_LISTING_S`` seconds, and whenever the index is missing or holds a damaged name, every writer folder is listed
instead (a shard published without its announcement is counted within that time). The figures steer admission
control and the trainer's wait; the plan itself never relies on them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from relax_hpc.errors import StoreError
from relax_hpc.rundir import RunDir
from relax_hpc.store.announce import Announced, list_announced
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


def _listing(rd: RunDir, done: dict[str, list[int]]) -> Announced:
    """Each writer's shards past ``done``: from the index, or from every writer folder (module docstring)."""
    now = time.monotonic()
    if now - _last_full.get(rd.root, -FULL_LISTING_S) < FULL_LISTING_S:
        index, damaged = list_announced(rd)
        if not damaged:
            return {w: [t for t in found if t[0] >= done.get(w, _NOTHING)[0]] for w, found in index.items()}
    if len(_last_full) > 256:
        _last_full.clear()
    _last_full[rd.root] = now
    return {w: scan_shards(rd, w, done.get(w, _NOTHING)[0]) for w in list_writers(rd)}


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
