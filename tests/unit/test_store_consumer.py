"""Consumer groups in one process: plans, rank splits, partial shards, staleness, backlog, retention, resume."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import h5py
import numpy as np
import pytest

from relax_hpc.errors import RunDirError, StoreError, WaitTimeout
from relax_hpc.fsio import read_json
from relax_hpc.rundir import RunDir
from relax_hpc.store import ConsumerGroup, Sample, ShardWriter, backlog
from relax_hpc.store import consumer as consumer_mod
from relax_hpc.store.shard_reader import LoadedShard, ShardFile
from tests.helpers.samples import group, uids


def test_plans_split_groups_across_ranks_exactly_once(rd: RunDir) -> None:
    w1, w2 = ShardWriter(rd, "rollout-0.a"), ShardWriter(rd, "rollout-1.b")
    for k in range(3):
        w1.write([group(f"a{k}.{j}") for j in range(2)])
        w2.write([group(f"b{k}.{j}") for j in range(2)])
    leader = ConsumerGroup(rd, world_size=2)
    other = ConsumerGroup(rd, rank=1, world_size=2)
    seen: list[str] = []
    for step in range(1, 7):
        plan = leader.plan(step, 8, timeout_s=1)
        assert plan.num_samples == 8 and plan.rank_samples == [4, 4]
        mine, theirs = leader.read(plan), other.read(other.wait_plan(step, timeout_s=1))
        assert len(mine) == len(theirs) == 4
        assert len({s.group_id for s in mine}) == 1  # whole groups per rank
        seen += uids(mine) + uids(theirs)
    assert len(seen) == len(set(seen)) == 48
    with pytest.raises(WaitTimeout, match="8 samples for step 7 of consumer 'trainer' \\(only 0 samples available\\)"):
        leader.plan(7, 8, timeout_s=0.2)
    with pytest.raises(StoreError, match="only rank 0 plans"):
        other.plan(7, 8)
    with pytest.raises(StoreError, match="not after the last planned step"):
        leader.plan(2, 8)


def test_partial_shards_and_num_groups(rd: RunDir) -> None:
    w = ShardWriter(rd, "w.0")
    w.write([group(f"g{j}", n=2 + j % 2) for j in range(5)])  # groups of 2,3,2,3,2 samples
    c = ConsumerGroup(rd)
    p1 = c.plan(1, num_groups=2, timeout_s=1)
    assert p1.num_samples == 5 and p1.position_after["writers"]["w.0"] == [0, 2, 5]
    p2 = c.plan(2, 3, timeout_s=1)  # >= 3 samples by whole groups
    assert p2.num_samples == 5 and p2.position_after["writers"]["w.0"] == [0, 4, 10]
    info = backlog(rd)
    assert (info.samples, info.groups, info.shards) == (2, 1, 1)
    p3 = c.plan(3, 10, timeout_s=1, wait=False)
    assert p3.num_samples == 2 and p3.position_after["writers"]["w.0"] == [1, 0, 0]
    got = uids(c.read(p1) + c.read(p2) + c.read(p3))
    assert len(got) == len(set(got)) == 12
    assert c.plan_available(4, 10).num_samples == 0


def test_staleness_drop_and_flag(rd: RunDir) -> None:
    w = ShardWriter(rd, "w.0")
    w.write([group("old", version=1), group("mixed", version=2)])
    w.write([group("new", version=5)])
    mixed = group("mixed2", version=5)
    mixed.samples[0].version = 3
    ShardWriter(rd, "w.1").write([mixed])
    flag = ConsumerGroup(rd, "flagger")
    plan = flag.plan(1, 12, min_version=4, stale_policy="flag", timeout_s=1)
    out = flag.read(plan)
    assert plan.stats["stale_flagged_samples"] == 9
    assert sorted(s.metadata["uid"] for s in out if s.stale) == sorted(
        [f"old/{i}" for i in range(4)] + [f"mixed/{i}" for i in range(4)] + ["mixed2/0"]
    )
    drop = ConsumerGroup(rd, "dropper")
    plan = drop.plan(1, 4, min_version=4, timeout_s=1)
    assert plan.stats["stale_dropped_samples"] == 12 and plan.stats["stale_dropped_groups"] == 3
    assert uids(drop.read(plan)) == [f"new/{i}" for i in range(4)]
    assert drop.counters["stale_dropped_samples"] == 12
    assert backlog(rd, "dropper").samples == 0  # dropped samples are consumed for good


def test_backlog_from_names_only(rd: RunDir) -> None:
    assert backlog(rd).samples == 0 and backlog(rd).min_version is None
    w = ShardWriter(rd, "w.0")
    w.write([group("a", version=2), group("b", n=2, version=3)])
    w.write([group("c", version=7)])
    ShardWriter(rd, "w.1").write([group("d", n=3, version=5)])
    info = backlog(rd)
    assert (info.samples, info.groups, info.shards, info.writers) == (13, 4, 3, 2)
    assert (info.min_version, info.max_version) == (2, 7)
    assert info.samples_by_version == {2: 6, 5: 3, 7: 4}
    assert info.batches_ahead(4) == 13 / 4
    c = ConsumerGroup(rd)
    c.plan(1, num_groups=1, timeout_s=1)
    assert backlog(rd).samples in (9, 10)  # planned, not yet committed: no longer backlog
    assert backlog(rd).position_step == 1


@pytest.mark.parametrize("retention", ["delete", "keep"])
def test_retention_only_after_commit(rd: RunDir, retention: str) -> None:
    w = ShardWriter(rd, "w.0")
    infos = [w.write([group(f"g{k}")]) for k in range(3)]
    c = ConsumerGroup(rd, retention=retention)
    plan = c.plan(1, 8, timeout_s=1)
    assert len(c.read(plan)) == 8
    assert all(i.path.exists() for i in infos)  # read but not committed: nothing deleted
    c.plan(2, 4, timeout_s=1)
    c.commit(c.position_after(1))
    assert read_json(rd.consumer_position())["writers"] == {"w.0": [2, 0, 0]}
    kept = retention == "keep"
    assert [i.path.exists() for i in infos] == [kept, kept, True]  # step 2 is planned, not committed


def test_resume_neither_skips_nor_repeats(rd: RunDir) -> None:
    w = ShardWriter(rd, "w.0")
    for k in range(6):
        w.write([group(f"g{k}")])
    c = ConsumerGroup(rd)
    trained: list[str] = []
    checkpoint = None
    for step in (1, 2, 3):
        plan = c.plan(step, 4, timeout_s=1)
        trained += uids(c.read(plan))
        if step == 2:
            checkpoint = {"position": c.position_after(2), "trained": list(trained)}
            c.commit(checkpoint["position"])
    plan3_before = read_json(rd.consumer_plan(3))
    # crash: step 3 was planned and read, but the checkpoint is the one of step 2
    w.write([group("late")])
    c2 = ConsumerGroup(rd)
    c2.resume(checkpoint["position"])
    trained = checkpoint["trained"]
    plan3 = c2.plan(3, 4, timeout_s=1)
    assert plan3.to_json() == plan3_before  # replayed, not re-planned
    trained += uids(c2.read(plan3))
    for step in (4, 5, 6, 7):
        trained += uids(c2.read(c2.plan(step, 4, timeout_s=1)))
    assert trained == [f"g{k}/{i}" for k in range(6) for i in range(4)] + [f"late/{i}" for i in range(4)]


def test_non_leader_ignores_plans_of_an_abandoned_chain(rd: RunDir) -> None:
    w = ShardWriter(rd, "w.0")
    for k in range(4):
        w.write([group(f"g{k}")])
    leader = ConsumerGroup(rd, world_size=2)
    p1 = leader.plan(1, 4, timeout_s=1)
    leader.plan(2, 4, timeout_s=1)
    leader.plan(3, 4, timeout_s=1)
    # restart from checkpoint 1; the old plan 3 (based on position after step 2) must not be read for step 2
    old_pos = p1.position_after
    follower = ConsumerGroup(rd, rank=1, world_size=2)
    follower.resume(old_pos)
    with pytest.raises(WaitTimeout):
        follower.wait_plan(3, timeout_s=0.3)  # plan 3 exists but continues another position
    assert follower.wait_plan(2, timeout_s=1).position_before["writers"] == old_pos["writers"]
    # a plan for another world size is re-planned, not replayed
    solo = ConsumerGroup(rd, world_size=1)
    solo.resume(old_pos)
    assert solo.plan(2, 4, timeout_s=1).world_size == 1
    assert read_json(rd.consumer_plan(2))["world_size"] == 1


def test_corrupt_shards_are_quarantined_and_counted(rd: RunDir, caplog: pytest.LogCaptureFixture) -> None:
    w = ShardWriter(rd, "w.0")
    good1 = w.write([group("ok1")])
    trunc = w.write([group("trunc")])
    flipped = w.write([group("flip0"), group("flip1")])
    good2 = w.write([group("ok2")])
    trunc.path.write_bytes(trunc.path.read_bytes()[:500])
    with h5py.File(flipped.path, "r") as f:
        offset = int(f["response_ids"].id.get_offset())
    data = bytearray(flipped.path.read_bytes())
    data[offset + 4] ^= 0x01  # inside group flip0
    flipped.path.write_bytes(bytes(data))
    c = ConsumerGroup(rd)
    with caplog.at_level(logging.WARNING, logger="relax_hpc.store"):
        plan = c.plan(1, 16, timeout_s=1)  # the damaged group is found at read time, not at plan time
        out = c.read(plan)
    assert plan.num_samples == 16 and plan.stats["quarantined_shards"] == ["w.0/" + trunc.path.name]
    assert uids(out) == [f"ok1/{i}" for i in range(4)] + [f"flip1/{i}" for i in range(4)] + [
        f"ok2/{i}" for i in range(4)
    ]
    assert c.counters["quarantined_shards"] == 2 and c.counters["quarantined_samples"] == 8
    for info in (trunc, flipped):
        assert not info.path.exists()
        qname = f"w.0.{info.path.name}"
        assert rd.quarantine_file(qname).exists()
        reason = json.loads(rd.quarantine_file(qname + ".reason.json").read_text())
        assert reason["shard"] == f"w.0/{info.path.name}" and reason["reason"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("quarantined corrupt shard" in m for m in warnings)
    assert str(trunc.path) in warnings[0] and "checksum mismatch in group(s) [0]" in warnings[1]
    assert good1.path.exists() and good2.path.exists()
    c.commit(plan.position_after)
    assert rd.quarantine_file(f"w.0.{trunc.path.name}").exists()  # retention never deletes quarantined shards


def flip_bit(path: Path, dataset: str, byte: int = 0) -> None:
    with h5py.File(path, "r") as f:
        offset = int(f[dataset].id.get_offset())
    data = bytearray(path.read_bytes())
    data[offset + byte] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damaged", ["before plan", "between plan and read"])
def test_group_in_quarantine_is_still_read_by_later_plans(rd: RunDir, damaged: str) -> None:
    info = ShardWriter(rd, "w.0").write([group("a"), group("b")])
    if damaged == "before plan":  # the leader reads the small shard's data when it plans it
        flip_bit(info.path, "response_ids")  # group a
        c = ConsumerGroup(rd)
    else:  # the data is read at read time: no data cache
        c = ConsumerGroup(rd, data_cache_bytes=0)
    p1 = c.plan(1, num_groups=1, timeout_s=1)
    assert p1.position_after["writers"]["w.0"] == [0, 1, 4]
    if damaged != "before plan":
        flip_bit(info.path, "response_ids")
    assert c.read(p1) == []  # group a is damaged: quarantined, not returned
    p2 = c.plan(2, 4, timeout_s=1)  # the partly consumed shard is found in quarantine
    assert uids(c.read(p2)) == [f"b/{i}" for i in range(4)]
    assert c.counters["quarantined_samples"] == 4


def test_leader_reads_small_shards_once(rd: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    w = ShardWriter(rd, "w.0")
    for k in range(3):
        w.write([group(f"g{k}.{j}") for j in range(4)])
    opened: list[str] = []
    real_load, real_open = consumer_mod.load_small, consumer_mod.open_shard

    def counting_load(path: Path, max_bytes: int) -> LoadedShard | None:
        opened.append(f"load {path.name}")
        return real_load(path, max_bytes)

    def counting_open(path: Path) -> ShardFile:
        opened.append(f"open {path.name}")
        return real_open(path)

    monkeypatch.setattr(consumer_mod, "load_small", counting_load)
    monkeypatch.setattr(consumer_mod, "open_shard", counting_open)
    c = ConsumerGroup(rd, data_cache_bytes=1 << 20)
    got: list[str] = []
    for step in range(1, 7):  # two steps per shard: its data is kept until both halves are read
        got += uids(c.read(c.plan(step, num_groups=2, timeout_s=1)))
        assert len(c._data) == step % 2
    assert got == [f"g{k}.{j}/{i}" for k in range(3) for j in range(4) for i in range(4)]
    assert len(opened) == 3 and all(o.startswith("load ") for o in opened)  # one read per shard, no HDF5 library
    tiny = ConsumerGroup(rd, "tiny", data_cache_bytes=100)  # shards bigger than the cache: read again to read
    assert len(tiny.read(tiny.plan(1, num_groups=2, timeout_s=1))) == 8 and not tiny._data
    assert len(opened) == 5
    monkeypatch.setattr(consumer_mod, "load_small", lambda path, max_bytes: None)  # e.g. a shard with tensors
    lib = ConsumerGroup(rd, "lib")
    assert uids(lib.read(lib.plan(1, num_groups=2, timeout_s=1))) == got[:8]
    assert opened[5:] == ["open 000000000000.s16.g4.v0-0.h5"]  # plan reads header and data in one open


def test_torn_or_missing_plan_file_is_planned_again(rd: RunDir) -> None:
    w = ShardWriter(rd, "w.0")
    for k in range(3):
        w.write([group(f"g{k}")])
    c = ConsumerGroup(rd)
    c.plan(1, 4, timeout_s=1)
    checkpoint = c.position_after(1)
    c.plan(2, 4, timeout_s=1)
    c.plan(3, 4, timeout_s=1)
    rd.consumer_plan(2).write_text('{"step": 2, "consu')  # a machine crash left it torn (no fsync)
    rd.consumer_plan(3).unlink()  # ... or lost it
    c2 = ConsumerGroup(rd)
    c2.resume(checkpoint)
    got = uids(c2.read(c2.plan(2, 4, timeout_s=1))) + uids(c2.read(c2.plan(3, 4, timeout_s=1)))
    assert got == [f"g{k}/{i}" for k in (1, 2) for i in range(4)]
    assert read_json(rd.consumer_plan(2))["position_before"]["writers"] == checkpoint["writers"]


def test_bad_positions_and_run_dirs(rd: RunDir, tmp_path: Path) -> None:
    c = ConsumerGroup(rd)
    with pytest.raises(StoreError, match="not a sample-store position"):
        c.resume({"writers": {}})
    with pytest.raises(StoreError, match="belongs to consumer 'other'"):
        c.resume({"format": 1, "consumer": "other", "writers": {}})
    rd.consumer_position().write_text("{not json")
    damaged = ConsumerGroup(rd)  # survives: a resuming trainer uses its checkpoint's copy of the position
    assert damaged.position_problem and "position.json" in damaged.position_problem
    with pytest.raises(StoreError, match="cannot read position file"):
        damaged.resume()  # ... but there is no committed position to fall back to
    damaged.resume({"format": 1, "consumer": "trainer", "writers": {}})
    assert backlog(rd).samples == 0  # writers' backlog survives the damaged file too
    for bad in (tmp_path / "nothing", tmp_path):
        with pytest.raises(RunDirError, match=r"does not exist|is not a relax-hpc run dir"):
            ConsumerGroup(bad)
        with pytest.raises(RunDirError):
            backlog(bad)


def test_planned_position_for_backlog(rd: RunDir) -> None:
    w = ShardWriter(rd, "w.0")
    for k in range(3):
        w.write([group(f"g{k}")])
    c = ConsumerGroup(rd)
    planned = rd.consumer_planned()
    c.plan(1, 4, timeout_s=1)
    assert not planned.is_symlink()  # a replaced link is hidden by network clients' entry caches (docs/netfs.md)
    assert json.loads(planned.read_text()) == json.loads(rd.consumer_plan(1).read_text())["position_after"]
    assert backlog(rd).samples == 8 and backlog(rd).position_step == 1
    checkpoint = c.position_after(1)
    c.plan(2, 4, timeout_s=1)
    assert backlog(rd).samples == 4 and backlog(rd).position_step == 2
    c2 = ConsumerGroup(rd)
    c2.resume(checkpoint)  # the planned position moves back with the chain
    assert not planned.is_symlink() and backlog(rd).samples == 8
    assert c2.plan(2, 4, timeout_s=1).num_samples == 4 and backlog(rd).samples == 4  # replayed
    planned.unlink()
    planned.write_text('{"format": 1, "cons')  # a crash of the machine tore it: only the figure is affected
    assert backlog(rd).samples == 12 and backlog(rd).position_step is None


def test_samples_to_items(rd: RunDir) -> None:
    from relax_hpc.trainer.items import samples_to_items

    ShardWriter(rd, "w.0").write([group("a", n=2, version=3)])
    c = ConsumerGroup(rd)
    read = c.read(c.plan(1, 2, timeout_s=1))
    loose = Sample(prompt_ids=[1, 2], response_ids=[3], logprobs=[-0.5], reward=1, version=2, group_id="b")
    items = samples_to_items([*read, loose])
    for s, item in zip(read, items, strict=False):
        assert item.sample is s and item.advantage == 0.0 and item.weight == 1.0  # the record itself, no copy
        assert (s.version, s.group_id, s.tensors) == (3, "a", {})
    last = items[-1].sample
    assert last is loose and last.mask().tolist() == [1] and last.mask().dtype == np.uint8
    assert (last.reward, last.version, last.group_id) == (1, 2, "b")
