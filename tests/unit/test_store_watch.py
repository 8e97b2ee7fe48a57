"""Change detection for the polling loops: a published shard, a new writer, a replaced file, the age fallback."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from relax_hpc.fsio import atomic_write_json
from relax_hpc.rundir import RunDir
from relax_hpc.store import ShardWriter
from relax_hpc.store.sample import Sample, SampleGroup
from relax_hpc.store.watch import files_watch, samples_watch


def _group(i: int) -> list[SampleGroup]:
    s = Sample(prompt_ids=np.arange(3), response_ids=np.arange(2), logprobs=np.zeros(2, np.float32), reward=1.0)
    return [SampleGroup(group_id=f"g{i}", samples=[s])]


def test_samples_watch_sees_new_writers_and_shards(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    watch = samples_watch(rd, max_age_s=3600)
    assert watch.changed()  # the first look is always a change
    assert not watch.changed()
    ShardWriter(rd, "w-a").write(_group(0))  # a new writer folder and its first shard
    assert watch.changed()
    assert not watch.changed()
    ShardWriter(rd, "w-b").write(_group(1))
    assert watch.changed()
    assert not watch.changed()
    ShardWriter(rd, "w-a").write(_group(2))  # a shard renamed into an existing writer folder
    assert watch.changed()
    assert not watch.changed()


def test_files_watch_sees_replacement_and_falls_back_on_age(tmp_path: Path) -> None:
    a, b = tmp_path / "planned.json", tmp_path / "LATEST"
    watch = files_watch(a, b, max_age_s=3600)
    assert watch.changed()
    assert not watch.changed()
    atomic_write_json(a, {"step": 1})  # appears
    assert watch.changed()
    assert not watch.changed()
    atomic_write_json(a, {"step": 2})  # replaced by rename: a new inode
    assert watch.changed()
    atomic_write_json(b, {"version": 3})
    assert watch.changed()
    assert not watch.changed()
    aged = files_watch(a, max_age_s=0.01)
    assert aged.changed()
    assert not aged.changed()
    time.sleep(0.02)
    assert aged.changed()  # nothing changed, but a full look is due
