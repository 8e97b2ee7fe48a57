"""Admission control between rollout workers: room is claimed under a lock, counted until the shard is published,
and a dead worker's old claim does not block the others."""

from __future__ import annotations

import json
import time
from pathlib import Path

from relax_hpc.modes.admission import Admission
from relax_hpc.rundir import RunDir


def test_claims_share_the_room_between_workers(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    a = Admission(rd, "rollout-0", limit=16)
    b = Admission(rd, "rollout-1", limit=16)
    assert a.try_claim(16, backlog_groups=lambda: 0)  # room for one batch: the first worker takes it
    assert a.try_claim(16, backlog_groups=lambda: 0)  # held: asking again does not claim twice
    assert not b.try_claim(16, backlog_groups=lambda: 0)  # the other worker's batch would be consumed a version later
    a.release()  # published: now its groups are in the backlog
    assert not b.try_claim(16, backlog_groups=lambda: 16)
    assert b.try_claim(16, backlog_groups=lambda: 0)  # the trainer planned them
    assert not a.try_claim(8, backlog_groups=lambda: 0)
    b.release()
    # smaller batches fill the room together
    assert a.try_claim(8, backlog_groups=lambda: 0) and b.try_claim(8, backlog_groups=lambda: 0)
    assert not Admission(rd, "rollout-2", limit=16).try_claim(8, backlog_groups=lambda: 0)


def test_a_dead_workers_old_claim_is_ignored(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    rd.claims.mkdir(parents=True, exist_ok=True)
    rd.claim_file("rollout-7").write_text(json.dumps({"groups": 16, "time": time.time() - 3600, "pid": 1}))
    assert Admission(rd, "rollout-0", limit=16, max_age_s=600).try_claim(16, backlog_groups=lambda: 0)


def test_a_restarted_worker_drops_its_own_old_claim(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    assert Admission(rd, "rollout-0", limit=16).try_claim(16, backlog_groups=lambda: 0)  # then killed while generating
    restarted = Admission(rd, "rollout-0", limit=16)
    assert not rd.claim_file("rollout-0").exists()
    assert restarted.try_claim(16, backlog_groups=lambda: 0)


def test_a_shard_published_while_the_store_is_listed_is_counted(tmp_path: Path) -> None:
    """Worker 0 publishes its shard and drops its claim just after worker 1's listing of the store missed the shard.
    The claims are read before the listing, so worker 1 still counts worker 0's batch (as its claim) and waits."""
    rd = RunDir.create(tmp_path / "run")
    a = Admission(rd, "rollout-0", limit=16)
    b = Admission(rd, "rollout-1", limit=16)
    assert a.try_claim(16, backlog_groups=lambda: 0)

    def listing_then_publish() -> int:
        seen = 0  # the listing ran before worker 0's shard appeared...
        a.release()  # ...which is published now, and its claim dropped
        return seen
    assert not b.try_claim(16, backlog_groups=listing_then_publish)
    assert not b.held and not rd.claim_file("rollout-1").exists()


def test_a_worker_claims_a_further_batch_on_top_of_its_own_and_releases_them_one_by_one(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    a = Admission(rd, "rollout-0", limit=16)
    assert a.try_claim(8, backlog_groups=lambda: 0) and a.held == 8
    assert not a.try_claim(8, backlog_groups=lambda: 1, more=True)  # 1 + 8 + 8 > 16: its own batch counts
    assert a.try_claim(8, backlog_groups=lambda: 0, more=True) and a.held == 16
    assert json.loads(rd.claim_file("rollout-0").read_text())["groups"] == 16  # what the other workers see
    assert not Admission(rd, "rollout-1", limit=16).try_claim(8, backlog_groups=lambda: 0)
    a.release(8)  # the first batch is published
    assert a.held == 8 and json.loads(rd.claim_file("rollout-0").read_text())["groups"] == 8
    assert not a.try_claim(16, backlog_groups=lambda: 0, more=True)  # a batch larger than the room left
    a.release(8)
    assert a.held == 0 and not rd.claim_file("rollout-0").exists()


def test_a_claim_of_a_dead_process_of_this_host_holds_no_room(tmp_path) -> None:
    """A worker killed while generating leaves its claim: on its own host the claim is ignored at once (its pid is
    gone), not after max_age_s; a claim from another host is trusted until then."""
    import json
    import socket
    import subprocess
    import sys

    from relax_hpc.rollout.admission import Admission
    from relax_hpc.rundir import RunDir

    rd = RunDir.create(tmp_path / "run")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    me = Admission(rd, "rollout-0", limit=4)
    rd.claims.mkdir(parents=True, exist_ok=True)
    rd.claim_file("rollout-1").write_text(json.dumps({"groups": 4, "time": time.time(), "pid": gone.pid,
                                                      "host": socket.gethostname()}))
    assert me.claimed_by_others() == 0 and me.try_claim(4, lambda: 0)
    me.release()
    rd.claim_file("rollout-1").write_text(json.dumps({"groups": 4, "time": time.time(), "pid": gone.pid,
                                                      "host": "another-node"}))
    assert me.claimed_by_others() == 4 and not me.try_claim(4, lambda: 0)
