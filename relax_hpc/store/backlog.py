"""Backlog figures from a directory listing and one small position file: what writers use for admission control."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from relax_hpc.rundir import RunDir
from relax_hpc.store.layout import check_consumer, empty_position, list_shards, list_writers, read_position
from relax_hpc.store.writer import open_run_dir


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
        read_position(rd.consumer_planned(consumer), consumer)
        or read_position(rd.consumer_position(consumer), consumer)
        or empty_position(consumer)
    )
    samples = groups = shards = 0
    writers_with_data = 0
    vmin: int | None = None
    vmax: int | None = None
    by_version: dict[int, int] = {}
    for w in list_writers(rd):
        seq, g_done, s_done = position["writers"].get(w, [0, 0, 0])
        refs = list_shards(rd, w, seq)
        if refs:
            writers_with_data += 1
        for ref in refs:
            g_left, s_left = ref.num_groups, ref.num_samples
            if ref.seq == seq:
                g_left, s_left = g_left - g_done, s_left - s_done
            samples += s_left
            groups += g_left
            shards += 1
            by_version[ref.min_version] = by_version.get(ref.min_version, 0) + s_left
            vmin = ref.min_version if vmin is None else min(vmin, ref.min_version)
            vmax = ref.max_version if vmax is None else max(vmax, ref.max_version)
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
