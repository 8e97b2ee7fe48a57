"""Backlog figures from a directory listing and one small position file: what writers use for admission control."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from relax_hpc.rundir import RunDir
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
    position = (
        read_planned(rd.consumer_planned(consumer), consumer)
        or read_position(rd.consumer_position(consumer), consumer)
        or empty_position(consumer)
    )
    samples = groups = shards = 0
    writers_with_data = 0
    vmin: int | None = None
    vmax: int | None = None
    by_version: dict[int, int] = {}
    done = position["writers"]
    for w in list_writers(rd):
        seq, g_done, s_done = done.get(w, _NOTHING)
        found = scan_shards(rd, w, seq)
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
