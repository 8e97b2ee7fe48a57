"""Resume after a kill mid-episode, with the real fully_async roles: the tiny tool task (its tool slowed down so
episodes stay in flight), the rollout worker - and, in another run, the trainer - SIGKILLed while episodes are in
flight (their marker files prove it), restarted, the run completed. The store's accounting then shows that no
sample was read twice and none was lost: every group of every published shard below the final read position
(the killed worker's included) was read by exactly one step's plan or counted as dropped for staleness."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.runutil import REPO, metrics, steps_around_restart

RECIPE = REPO / "recipes" / "tiny-digit-lookup-tool.yaml"
SLOW_ENV = Path(__file__).parents[1] / "helpers" / "agentic_slow_env.py"


def _start(run: Path, markers: Path, *extra: str) -> dict[str, int]:
    args = ["submit", str(RECIPE), "--executor", "local", "--run-dir", str(run), "--detach",
            "--set", "mode=fully_async", "--set", "warmup.steps=0", "--set", "rollout.num_workers=1",
            "--set", "rollout.prompts_per_step=4",
            "--set", "rollout.batch_prompts=4", "--set", "rollout.n_samples=4", "--set", "store.retention=keep",
            "--set", f"rollout.env.name={SLOW_ENV}:SlowDigitLookupEnv",
            "--set", "rollout.env.kwargs.delay_s=0.3", "--set", f"rollout.env.kwargs.marker_dir={markers}", *extra]
    p = subprocess.run([sys.executable, "-m", "relax_hpc", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    return {r["proc"]: r["pid"] for r in json.loads((run / "launch.json").read_text())["procs"]}


@pytest.fixture
def started() -> Iterator[list[int]]:
    """Pids of the roles a test started: SIGKILLed at teardown if still alive and still a role of a run of this
    test (its command line names the test's folder: a reused pid is left alone), so a failed test leaves nothing."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if _alive(pid) and b"relax_hpc" in cmdline and b"test_" in cmdline and b"killed_mid" in cmdline:
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait(what: str, cond: Callable[[], object], timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def _trainer_steps(run: Path) -> list[int]:
    path = run / "logs/events/trainer-0.jsonl"
    if not path.exists():
        return []
    return [rec["step"] for rec in metrics(run, "trainer-0") if "rollout/reward" in rec["metrics"]]


def _published(run: Path) -> int:
    return len(list((run / "samples" / "shards").glob("rollout-0.*/*.h5")))


def _kill_mid_episode(run: Path, markers: Path, pid: int, rollout_pid: int, min_steps: int) -> int:
    """SIGKILL ``pid`` once the trainer has done ``min_steps`` steps, a shard is out and the worker has episodes in
    flight; returns how many were in flight."""
    _wait(f"{min_steps} trainer steps and a shard", lambda: len(_trainer_steps(run)) >= min_steps
          and _published(run) >= 1, 600)
    _wait("episodes in flight", lambda: any(markers.glob(f"{rollout_pid}.*")), 120)
    os.kill(pid, signal.SIGKILL)
    _wait(f"pid {pid} to exit", lambda: not _alive(pid), 60)
    return len(list(markers.glob(f"{rollout_pid}.*")))


def _role(run: Path, role: str, rank: int) -> subprocess.Popen:
    log = open(run / "logs" / f"{role}-{rank}.restart.out", "ab")  # noqa: SIM115 - the child keeps it
    return subprocess.Popen([sys.executable, "-m", "relax_hpc", "role", role, "--run-dir", str(run), "--rank",
                             str(rank)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})


def store_accounting(run: Path) -> dict[str, int]:
    """Check the trainer's read history against the store: the plans chain, no group is read twice, and every
    group below the final position was read or counted as stale. Returns the figures."""
    from relax_hpc.rundir import RunDir
    from relax_hpc.store import read_shard
    from relax_hpc.store.layout import list_shards, list_writers, store_paths

    rd = RunDir.open(run)
    plans = [json.loads(p.read_text()) for p in sorted((run / "samples/consumers/trainer/plans").glob("step_*.json"))]
    assert [p["step"] for p in plans] == list(range(len(plans)))  # plan sequence numbers (several per step)
    for a, b in itertools.pairwise(plans):
        assert b["position_before"] == a["position_after"], f"plan chain broken at step {b['step']}"
    read: dict[tuple[str, int], int] = {}
    for p in plans:
        for runs in p["ranks"]:
            for idx, g0, g1 in runs:
                for g in range(g0, g1):
                    key = (p["shards"][idx], g)
                    assert key not in read, f"group {key} read by steps {read[key]} and {p['step']}"
                    read[key] = p["step"]
    stale = sum(int(p["stats"].get("stale_dropped_groups", 0)) for p in plans)
    assert all(not p["stats"].get("quarantined_shards") for p in plans)
    final = plans[-1]["position_after"]["writers"]
    below: set[tuple[str, int]] = set()
    group_ids: dict[tuple[str, int], str] = {}
    sizes: dict[tuple[str, int], int] = {}
    for w in list_writers(rd):
        nseq, ngroup, _ = final.get(w, [0, 0, 0])
        for ref in list_shards(rd, w):
            samples = read_shard(store_paths(rd).writer_folder(w) / ref.name)
            for gi, gid in enumerate(dict.fromkeys(s.group_id for s in samples)):
                sizes[(ref.rel, gi)] = sum(s.group_id == gid for s in samples)
                group_ids[(ref.rel, gi)] = gid
                if ref.seq < nseq or (ref.seq == nseq and gi < ngroup):
                    below.add((ref.rel, gi))
    assert set(read) <= below, sorted(set(read) - below)[:5]
    assert len(below) - len(read) == stale, f"{len(below) - len(read)} groups neither read nor counted as stale"
    assert len({group_ids[k] for k in read}) == len(read)  # group ids unique: no sample read twice under two names
    assert sum(sum(p["rank_samples"]) for p in plans) == sum(sizes[k] for k in read)
    return {"plans": len(plans), "groups_read": len(read), "samples_read": sum(sizes[k] for k in read),
            "stale_dropped_groups": stale, "groups_published": len(sizes), "writers": len(list_writers(rd))}


@pytest.mark.integration
def test_rollout_worker_killed_mid_episode_resumes_exactly_once(tmp_path: Path, started: list[int]) -> None:
    run, markers = tmp_path / "run", tmp_path / "markers"
    pids = _start(run, markers, "--set", "num_steps=14", "--set", "max_staleness=2")
    started += pids.values()
    in_flight = _kill_mid_episode(run, markers, pids["rollout-0"], pids["rollout-0"], 3)
    assert in_flight >= 1  # episodes the kill interrupted (close() never ran)
    from relax_hpc.rundir import RunDir
    from relax_hpc.store.layout import list_writers

    killed = list_writers(RunDir.open(run))
    restarted = _role(run, "rollout", 0)
    started.append(restarted.pid)
    try:
        _wait("the trainer to finish", lambda: not _alive(pids["trainer-0"]), 600)
        assert restarted.wait(timeout=120) == 0
    finally:
        if restarted.poll() is None:
            restarted.kill()
    assert json.loads((run / "STATUS.json").read_text())["state"] == "completed"
    assert _trainer_steps(run) == list(range(1, 15))
    acc = store_accounting(run)
    rd = RunDir.open(run)
    assert len(killed) == 1 and len(list_writers(rd)) == 2  # the restarted worker is a new writer incarnation
    plans = sorted((run / "samples/consumers/trainer/plans").glob("step_*.json"))
    final = json.loads(plans[-1].read_text())["position_after"]["writers"]
    from relax_hpc.store.layout import list_shards

    dead = killed[0]
    assert final[dead][0] == len(list_shards(rd, dead)) and final[dead][1:] == [0, 0]  # all its shards passed
    print(json.dumps({"rollout_killed": acc, "episodes_in_flight_at_kill": in_flight}))


@pytest.mark.integration
def test_trainer_killed_mid_episode_resumes_exactly_once(tmp_path: Path, started: list[int]) -> None:
    run, markers = tmp_path / "run", tmp_path / "markers"
    pids = _start(run, markers, "--set", "num_steps=14", "--set", "trainer.checkpoint_every=3",
                  "--set", "max_staleness=2")
    started += pids.values()
    in_flight = _kill_mid_episode(run, markers, pids["trainer-0"], pids["rollout-0"], 5)
    assert in_flight >= 1
    ckpt = int((run / "checkpoints" / "LATEST").read_text())
    assert ckpt >= 3
    trainer = _role(run, "trainer", 0)
    started.append(trainer.pid)
    try:
        assert trainer.wait(timeout=600) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
    _wait("the rollout worker to finish", lambda: not _alive(pids["rollout-0"]), 120)
    assert json.loads((run / "STATUS.json").read_text())["state"] == "completed"
    before, after = steps_around_restart(run, "trainer-0", pids["trainer-0"])
    assert before == list(range(1, len(before) + 1)) and ckpt <= len(before) + 1
    assert after == list(range(ckpt + 1, 15))
    acc = store_accounting(run)
    assert acc["plans"] >= 14 and acc["samples_read"] >= 14 * 16  # at least a whole batch per step was read
    print(json.dumps({"trainer_killed": acc, "checkpoint": ckpt, "episodes_in_flight_at_kill": in_flight}))
