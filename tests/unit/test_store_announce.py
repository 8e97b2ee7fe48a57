"""The announcement index of the sample store: plans read it instead of every writer folder, and fall back to the
full scan whenever it may be wrong (a writer killed between publish and announce, a lost or damaged announcement, an
announced shard not visible yet), so no sample is ever hidden for long, lost or read twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_hpc.rundir import RunDir
from relax_hpc.store import ConsumerGroup, ShardWriter
from relax_hpc.store.announce import list_announced
from relax_hpc.store.layout import list_shards, list_writers
from relax_hpc.store.watch import samples_watch
from tests.helpers.samples import group, uids

backlog_mod = sys.modules["relax_hpc.store.backlog"]



def _unannounce(rd: RunDir, writer_id: str, name: str) -> None:
    """The state a writer killed between its shard's rename and its announcement leaves: neither the announcement
    nor the head names the shard."""
    rd.announce_file(writer_id, name).unlink()
    head = json.loads(rd.head_file(writer_id).read_text())
    rd.head_file(writer_id).write_text(json.dumps({"shards": [n for n in head["shards"] if n != name]}))

def _drain(c: ConsumerGroup, step: int, per_step: int = 4) -> tuple[list[str], int]:
    """Plan and read with ``wait=False`` until a plan comes back empty; the uids read and the next step."""
    seen: list[str] = []
    while True:
        plan = c.plan_available(step, per_step)
        if plan.num_samples == 0:
            return seen, step + 1
        seen += uids(c.read(plan))
        step += 1


def test_each_shard_is_announced_and_commit_removes_consumed_announcements(rd: RunDir) -> None:
    w = ShardWriter(rd, "rollout-0.a")
    infos = [w.write([group(f"g{k}")]) for k in range(4)]
    index, damaged = list_announced(rd)
    assert damaged == 0 and [t[0] for t in index["rollout-0.a"]] == [0, 1, 2, 3]
    assert sorted(os.listdir(rd.announce)) == sorted(f"rollout-0.a.{i.path.name}" for i in infos)
    c = ConsumerGroup(rd)
    seen, step = _drain(c, 1)
    assert len(seen) == len(set(seen)) == 16
    assert c.counters["full_scans"] == 1 and c.counters["index_plans"] >= 3  # only the first plan scanned fully
    c.commit(c.position_after(step - 1))
    assert os.listdir(rd.announce) == [] and list_shards(rd, "rollout-0.a") == []
    assert c.counters["announcements_retired"] == 4


def test_retention_keep_still_removes_announcements(rd: RunDir) -> None:
    w = ShardWriter(rd, "rollout-0.a")
    for k in range(3):
        w.write([group(f"g{k}")])
    c = ConsumerGroup(rd, retention="keep")
    seen, step = _drain(c, 1)
    c.commit(c.position_after(step - 1))
    assert len(seen) == 12 and os.listdir(rd.announce) == [] and len(list_shards(rd, "rollout-0.a")) == 3


def test_publish_without_announcement_is_found_by_a_short_plan(rd: RunDir) -> None:
    """The state a writer killed between its rename and its announcement leaves: a published, unannounced shard."""
    w = ShardWriter(rd, "rollout-0.a")
    w.write([group("g0")])
    c = ConsumerGroup(rd)
    assert uids(c.read(c.plan(1, 4, timeout_s=5))) == [f"g0/{i}" for i in range(4)]  # first plan: full scan
    info = w.write([group("g1")])
    _unannounce(rd, "rollout-0.a", info.path.name)  # killed before the announcement
    time.sleep(1.1)  # SHORT_RESCAN_S since the last full scan
    plan = c.plan(2, 4, timeout_s=5)
    assert uids(c.read(plan)) == [f"g1/{i}" for i in range(4)]
    assert c.counters["full_scans"] == 2
    # the unannounced shard is consumed once: the next plan from the index does not see it again
    w.write([group("g2")])
    plan = c.plan(3, 4, timeout_s=5)
    assert uids(c.read(plan)) == [f"g2/{i}" for i in range(4)] and c.counters["full_scans"] == 2


def test_unannounced_shard_is_found_by_the_periodic_scan(rd: RunDir) -> None:
    """Enough data from the index never hides an unannounced shard for longer than ``full_scan_s``."""
    a, b = ShardWriter(rd, "rollout-0.a"), ShardWriter(rd, "rollout-1.b")
    c = ConsumerGroup(rd, full_scan_s=60.0)  # no periodic scan between the first plans, however slow the machine
    a.write([group("a0")])
    c.read(c.plan(1, 4, timeout_s=5))
    hidden = b.write([group("b0", version=0)])
    _unannounce(rd, "rollout-1.b", hidden.path.name)
    a.write([group("a1", version=1)])
    assert uids(c.read(c.plan(2, 4, timeout_s=5)))[0].startswith("a1/")  # from the index: b0 not seen
    c.full_scan_s = 0.0  # the period has passed
    a.write([group("a2", version=2)])
    got = uids(c.read(c.plan(3, 4, timeout_s=5)))
    assert got[0].startswith("b0/")  # the periodic full scan found it (oldest version first)


def test_gap_in_announcements_lists_that_writer(rd: RunDir) -> None:
    w = ShardWriter(rd, "rollout-0.a")
    w.write([group("g0")])
    c = ConsumerGroup(rd)
    c.read(c.plan(1, 4, timeout_s=5))
    infos = [w.write([group(f"g{k}")]) for k in range(1, 4)]
    _unannounce(rd, "rollout-0.a", infos[0].path.name)  # shard 1 unannounced, 2 and 3 announced
    seen, _ = _drain(c, 2)
    assert seen == [f"g{k}/{i}" for k in range(1, 4) for i in range(4)]  # in seq order, none skipped
    assert c.counters["index_gaps"] >= 1


def test_announced_shard_not_visible_is_not_lost(rd: RunDir) -> None:
    """An announcement whose shard is not visible (a cached negative lookup, a rename not yet durable) ends that
    writer's queue for the plan: nothing is counted lost and the position does not pass it."""
    w = ShardWriter(rd, "rollout-0.a")
    w.write([group("g0")])
    c = ConsumerGroup(rd)
    c.read(c.plan(1, 4, timeout_s=5))
    info = w.write([group("g1")])
    aside = info.path.with_name(".aside")
    os.rename(info.path, aside)  # announced, not visible
    plan = c.plan_available(2, 4)
    assert plan.num_samples == 0 and plan.stats["quarantined_samples"] == 0
    assert c.counters["index_missing"] >= 1 and c.position["writers"]["rollout-0.a"] == [1, 0, 0]
    os.rename(aside, info.path)
    assert uids(c.read(c.plan(3, 4, timeout_s=5))) == [f"g1/{i}" for i in range(4)]


def test_damaged_announcement_means_full_scans(rd: RunDir) -> None:
    w = ShardWriter(rd, "rollout-0.a")
    (rd.announce / "garbage \x01 name").write_bytes(b"x" * 100)
    for k in range(3):
        w.write([group(f"g{k}")])
    c = ConsumerGroup(rd)
    seen, step = _drain(c, 1)
    assert len(seen) == len(set(seen)) == 12
    assert c.counters["index_damaged"] >= 1 and c.counters["index_plans"] == 0
    c.commit(c.position_after(step - 1))
    assert os.listdir(rd.announce) == ["garbage \x01 name"]  # left for a person; announcements are removed


def test_run_dir_without_announce_folder(rd: RunDir) -> None:
    """A run dir made before the index existed: writers create the folder, the planner scans until it exists."""
    c = ConsumerGroup(rd)
    w = ShardWriter(rd, "rollout-0.a")
    rd.announce.rmdir()
    assert len(uids(c.read(c.plan_available(1, 4)))) == 0
    info = w.write([group("g0")])
    assert rd.announce_file("rollout-0.a", info.path.name).is_file()
    assert len(uids(c.read(c.plan(2, 4, timeout_s=5)))) == 4


_WRITER = """
import sys, numpy as np
from relax_hpc.store import ShardWriter
from tests.helpers.samples import group
w = ShardWriter(sys.argv[1], sys.argv[2], fsync=False)
k = 0
while True:
    w.write([group(f"{sys.argv[2]}-{k}")])
    k += 1
    print(k, flush=True)
"""


def test_killed_writers_lose_nothing_and_duplicate_nothing(rd: RunDir) -> None:
    """Real writer processes SIGKILLed at random moments (some between a rename and its announcement) while the
    trainer plans from the index: every published sample is read exactly once."""
    c = ConsumerGroup(rd, full_scan_s=3600.0)  # only the first plan and short plans scan fully
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    seen: list[str] = []
    step = 1
    rng = __import__("random").Random(7)
    for i in range(6):
        p = subprocess.Popen([sys.executable, "-c", _WRITER, str(rd.root), f"rollout-{i}.k"], env=env,
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        for _ in range(rng.randint(3, 12)):  # at least 3 shards published
            assert p.stdout.readline(), "writer died"
        time.sleep(rng.random() * 0.05)
        p.send_signal(signal.SIGKILL)
        assert p.wait(timeout=30) == -signal.SIGKILL
        got, step = _drain(c, step, per_step=8)
        seen += got
        time.sleep(1.1)  # the next short look may scan fully
        got, step = _drain(c, step, per_step=8)
        seen += got
    published = [f"{ref.writer_id}-{ref.seq}" for w in list_writers(rd) for ref in list_shards(rd, w)]
    assert len(seen) == len(set(seen)) == 4 * len(published)
    assert {u.rsplit("/", 1)[0] for u in seen} == set(published)
    c.commit(c.position_after(step - 1))
    assert os.listdir(rd.announce) == []


def test_samples_watch_stats_the_announce_folder(rd: RunDir) -> None:
    """The trainer's change watch: two stats a poll for any number of writers (stat-only: an attribute cache hides
    the change by design, so the network-mount tier deselects this; the watch's age fallback covers it there)."""
    watch = samples_watch(rd, max_age_s=3600)
    assert watch.changed() and not watch.changed()
    a = ShardWriter(rd, "rollout-0.a")
    a.write([group("a0")])
    assert watch.changed() and not watch.changed()  # the announcement changed samples/announce
    for k in range(1, 4):
        ShardWriter(rd, f"rollout-{k}.x").write([group(f"x{k}")])
        assert watch.changed() and not watch.changed()
    hidden = a.write([group("a1")])
    _unannounce(rd, "rollout-0.a", hidden.path.name)
    assert watch.changed()  # (the unlink changed the folder too; an unannounced shard is left to the age fallback)


def test_backlog_reads_the_index_and_lists_every_folder_at_times(rd: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Admission control's backlog lists one folder for any number of writers; an unannounced shard is counted by
    the periodic full listing (``FULL_LISTING_S``). The period is set per look, not timed: on a slow network mount
    the writes between two looks can outlast any short period."""
    monkeypatch.setattr(backlog_mod, "FULL_LISTING_S", 3600.0)
    a = ShardWriter(rd, "rollout-0.a")
    a.write([group("a0")])
    assert backlog_mod.backlog(rd).groups == 1  # the first look lists every folder
    hidden = ShardWriter(rd, "rollout-1.b").write([group("b0")])
    _unannounce(rd, "rollout-1.b", hidden.path.name)
    a.write([group("a1")])
    assert backlog_mod.backlog(rd).groups == 2  # from the index: b0 not counted yet
    monkeypatch.setattr(backlog_mod, "FULL_LISTING_S", 0.0)  # the period is over
    info = backlog_mod.backlog(rd)
    assert info.groups == 3 and info.writers == 2  # the periodic full listing counts it


def test_commit_lists_only_the_writers_that_advanced(rd: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    from relax_hpc.store import retention

    listed: list[str] = []
    real = retention.list_shards
    monkeypatch.setattr(retention, "list_shards", lambda r, w, *a: listed.append(w) or real(r, w, *a))
    ws = [ShardWriter(rd, f"rollout-{k}.w") for k in range(3)]
    for w in ws:
        w.write([group(f"{w.writer_id}-0")])
    c = ConsumerGroup(rd)
    seen, step = _drain(c, 1)
    c.commit(c.position_after(step - 1))
    assert sorted(listed) == [w.writer_id for w in ws] and len(seen) == 12
    listed.clear()
    ws[1].write([group("again")])
    seen, step = _drain(c, step)
    c.commit(c.position_after(step - 1))
    assert listed == ["rollout-1.w"] and seen == [f"again/{i}" for i in range(4)]
    assert all(list_shards(rd, w.writer_id) == [] for w in ws) and os.listdir(rd.announce) == []


def test_streaming_plans_short_by_design_read_the_index(rd: RunDir) -> None:
    """``plan_available`` takes what is there: a short plan from the index is normal and lists no writer folder;
    an empty one lists them all (at most once per SHORT_RESCAN_S)."""
    w = ShardWriter(rd, "rollout-0.a")
    c = ConsumerGroup(rd)
    assert c.plan_available(1, 4).num_samples == 0 and c.counters["full_scans"] == 1
    time.sleep(1.1)
    for step in range(2, 6):
        w.write([group(f"g{step}")])
        assert c.plan_available(step, 16).num_samples == 4  # a quarter of what was asked
    assert c.counters["full_scans"] == 1 and c.counters["index_plans"] == 4
    time.sleep(1.1)
    assert c.plan_available(6, 16).num_samples == 0 and c.counters["full_scans"] == 2


def test_shard_named_by_its_writers_head_is_planned_without_a_listing(rd: RunDir) -> None:
    """A listing served from a directory cache hides a new announcement; the writer's head (read by name) names the
    shard, so the plan takes it from the index at once, without a full scan of the writer folders."""
    w = ShardWriter(rd, "rollout-0.a")
    w.write([group("g0")])
    c = ConsumerGroup(rd)
    c.read(c.plan(1, 4, timeout_s=5))  # first plan: a full scan
    info = w.write([group("g1")])
    rd.announce_file("rollout-0.a", info.path.name).unlink()  # as a cached listing would show the folder
    assert info.path.name in json.loads(rd.head_file("rollout-0.a").read_text())["shards"]
    plan = c.plan(2, 4, timeout_s=5)
    assert uids(c.read(plan)) == [f"g1/{i}" for i in range(4)]
    assert c.counters["full_scans"] == 1 and c.counters["index_plans"] >= 1
