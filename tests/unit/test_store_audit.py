"""The store audit (relax_hpc.store.audit): real shards and plans through ShardWriter and ConsumerGroup, a consumer
restarted from an older position, stale drops and quarantined shards; it balances, and it fails when a plan is
missing (groups lost), when a plan reads a group twice, or when a plan's stats disagree with what it skipped."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.rundir import RunDir
from relax_hpc.store import ConsumerGroup, Sample, SampleGroup, ShardWriter
from relax_hpc.store.audit import audit


def group(gid: str, version: int = 0, n: int = 4) -> SampleGroup:
    return SampleGroup(gid, [Sample(prompt_ids=np.arange(3, dtype=np.int32), response_ids=np.full(5, i, np.int32),
                                    logprobs=np.zeros(5, np.float32), reward=float(i), version=version)
                             for i in range(n)])


@pytest.fixture
def rd(tmp_path: Path) -> RunDir:
    """Two writers, 9 groups of 4 samples: 2 stale, 1 in a truncated shard; 4 plans of 1-2 groups, the consumer
    restarted once from the position after plan 1 (plan 2 replayed), committed after plan 4; 1 group unread."""
    rd = RunDir.create(tmp_path / "run")
    w0, w1 = ShardWriter(rd, "w.0", fsync=False), ShardWriter(rd, "w.1", fsync=False)
    w0.write([group("a0", 0), group("a1", 0)])  # stale at min_version 1
    w1.write([group("b0", 2)])
    bad = w1.write([group("b1", 2)])
    bad.path.write_bytes(bad.path.read_bytes()[:300])  # truncated: quarantined when planned
    w0.write([group("a2", 2), group("a3", 2)])
    w1.write([group("b2", 3), group("b3", 3), group("b4", 3)])
    c = ConsumerGroup(rd, retention="keep", keep_plans=1000)
    p1 = c.plan(1, num_groups=1, min_version=1, timeout_s=1)
    c.read(p1)
    c.commit(p1.position_after)
    c.read(c.plan(2, num_groups=2, min_version=1, timeout_s=1))  # then a crash: no commit
    c = ConsumerGroup(rd, retention="keep", keep_plans=1000)
    c.resume(p1.position_after)
    for step in (2, 3, 4):
        plan = c.plan(step, num_groups=2 if step < 4 else 1, min_version=1, timeout_s=1)
        c.read(plan)
    c.commit(plan.position_after)
    return rd


def test_a_sound_store_balances(rd: RunDir) -> None:
    a = audit(rd)
    assert a.problems == [] and a.balanced, a.to_json()
    assert (a.plans, a.produced_groups, a.consumed_groups, a.dropped_groups, a.quarantined_groups,
            a.unread_groups, a.lost_groups, a.duplicated_groups) == (4, 9, 6, 2, 1, 0, 0, 0), a.to_json()
    assert (a.produced, a.consumed, a.dropped, a.quarantined) == (36, 24, 8, 4)


def test_a_missing_plan_means_lost_groups(rd: RunDir) -> None:
    rd.consumer_plan(2).unlink()
    a = audit(rd)
    assert not a.balanced and a.lost_groups > 0 and any("chain breaks" in p for p in a.problems), a.to_json()


def test_a_group_read_twice_is_duplicated(rd: RunDir) -> None:
    path = rd.consumer_plan(4)
    plan = json.loads(path.read_text())
    first = json.loads(rd.consumer_plan(2).read_text())
    plan["shards"].append(first["shards"][0])
    plan["ranks"][0].append([len(plan["shards"]) - 1, 0, 1])
    path.write_text(json.dumps(plan))
    a = audit(rd)
    assert a.duplicated_groups == 1 and not a.balanced and any("outside" in p for p in a.problems), a.to_json()


def test_stats_must_account_for_what_a_plan_skipped(rd: RunDir) -> None:
    path = rd.consumer_plan(1)
    plan = json.loads(path.read_text())
    assert plan["stats"]["stale_dropped_groups"] == 2
    plan["stats"]["stale_dropped_groups"] = 0
    path.write_text(json.dumps(plan))
    a = audit(rd)
    assert not a.balanced and any("drops 0 as stale" in p for p in a.problems), a.to_json()
