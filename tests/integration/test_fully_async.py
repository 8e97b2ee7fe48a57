"""Mode fully_async with real processes: the trainer and 2 rollout workers overlap through the run dir; the reward
rises; a rollout worker SIGKILLed mid-run is noticed and the run goes on; a restarted worker rejoins at the latest
version; a trainer SIGKILLed and restarted resumes from its checkpoint with no shard consumed twice."""

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
from relax_hpc.trainer.checkpoint import latest_checkpoint
from tests.helpers.runutil import DEMO, REPO, cli, metrics, rewards, steps_around_restart

ASYNC = ["--set", "mode=fully_async", "--set", "rollout.prompts_per_step=8", "--set", "rollout.batch_prompts=4"]


def _start(run: Path, *extra: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "relax_hpc", "submit", str(DEMO), "--executor", "local",
                        "--run-dir", str(run), "--detach", *ASYNC, *extra], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return {r["proc"]: r["pid"] for r in json.loads((run / "launch.json").read_text())["procs"]}


def _wait_steps(run: Path, n: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    path = run / "logs/events/trainer-0.jsonl"
    while time.time() < deadline:
        if path.exists() and len(rewards(run, "trainer-0")) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"trainer did not reach step {n}")


def _wait_exit(pid: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
                return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    raise AssertionError(f"pid {pid} still running")


def _role(run: Path, role: str, rank: int) -> subprocess.Popen:
    log = open(run / "logs" / f"{role}-{rank}.restart.out", "ab")  # noqa: SIM115 - the child keeps it
    return subprocess.Popen([sys.executable, "-m", "relax_hpc", "role", role, "--run-dir", str(run), "--rank",
                             str(rank)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.integration
def test_fully_async_reward_rises_and_staleness_is_bounded(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), "--set", "num_steps=120",
               "--set", "mode=fully_async")
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = rewards(run, "trainer-0")
    assert len(r) == 120
    first, last = sum(r[:5]) / 5, sum(r[-10:]) / 10
    assert last >= first + 0.12, (first, last)
    ms = [rec["metrics"] for rec in metrics(run, "trainer-0") if "rollout/staleness_max" in rec["metrics"]]
    assert max(m["rollout/staleness_max"] for m in ms) <= 1  # max_staleness: 1 (older samples are dropped)
    assert all(0.0 <= m["perf/train_idle_fraction"] <= 1.0 for m in ms)
    # both workers contributed
    for w in ("rollout-0", "rollout-1"):
        assert metrics(run, w), f"{w} wrote no metrics"
        # the worker's hf engine decodes in its slot pool (batch_prompts x n_samples rows) and reports occupancy
        decode = [rec["metrics"] for rec in metrics(run, w) if "perf/decode_occupancy" in rec["metrics"]]
        assert decode and all(m["perf/decode_slots"] == 128 and 0 < m["perf/decode_occupancy"] <= 1
                              for m in decode)


@pytest.mark.integration
def test_rollout_worker_killed_run_goes_on_and_restart_rejoins_latest(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # long enough that the restarted worker (a new Python process) joins while the trainer still trains
    pids = _start(run, "--set", "num_steps=400", "--set", "warmup.steps=2", "--set", "monitor.dead_after_s=3")
    _wait_steps(run, 5)
    os.kill(pids["rollout-1"], signal.SIGKILL)
    _wait_exit(pids["rollout-1"])
    time.sleep(4)
    snap = json.loads(cli("monitor", str(run), "--json").stdout)
    assert snap["roles"]["rollout-1"]["state"] == "dead"
    assert snap["roles"]["rollout-0"]["state"] in ("running", "paused")
    n = len(rewards(run, "trainer-0"))
    _wait_steps(run, n + 3)  # training goes on with the other worker
    from relax_hpc.weights import latest_version

    latest = latest_version(run)
    restarted = _role(run, "rollout", 1)
    deadline = time.time() + 120
    versions: list[float] = []
    while time.time() < deadline and not versions:
        ms = [m for m in metrics(run, "rollout-1") if m["time"] > time.time() - 60 and m["pid"] == restarted.pid]
        versions = [m["metrics"]["rollout/version"] for m in ms]
        time.sleep(0.2)
    assert versions and versions[0] >= latest  # rejoined at (at least) the version published before it started
    for p in pids.values():
        _wait_exit(p, timeout=300) if p != pids["rollout-1"] else None
    restarted.wait(timeout=120)
    assert json.loads((run / "STATUS.json").read_text())["state"] == "completed"


@pytest.mark.integration
def test_trainer_sigkill_restart_resumes_without_double_consumption(tmp_path: Path) -> None:
    run = tmp_path / "run"
    pids = _start(run, "--set", "num_steps=80", "--set", "warmup.steps=2", "--set", "trainer.checkpoint_every=4",
                  "--set", "store.retention=keep")  # 80: still running after step 10 on a faster machine too
    _wait_steps(run, 10)
    assert not (run / "STATUS.json").exists(), "the run ended before the kill"
    os.kill(pids["trainer-0"], signal.SIGKILL)
    _wait_exit(pids["trainer-0"])
    newest = latest_checkpoint(RunDir(run))  # the truth; LATEST lags it when the kill fell between the two moves
    assert newest is not None
    ckpt = int(newest.name.removeprefix("step_"))
    assert ckpt >= 4
    trainer = _role(run, "trainer", 0)
    assert trainer.wait(timeout=600) == 0
    for name in ("rollout-0", "rollout-1"):
        _wait_exit(pids[name], timeout=120)
    before, after = steps_around_restart(run, "trainer-0", pids["trainer-0"])
    assert before == list(range(1, len(before) + 1)) and len(before) >= 10
    assert ckpt <= len(before) + 1  # a kill between a checkpoint and its step's metrics line: one step unlogged
    assert after == list(range(ckpt + 1, 81))  # resumed right after its checkpoint, to the end
    # the plan chain after the restart continues from the checkpoint's position: no shard group read twice
    plans = sorted((run / "samples/consumers/trainer/plans").glob("step_*.json"))
    seen: dict[str, set[int]] = {}
    for p in plans:
        plan = json.loads(p.read_text())
        for runs in plan["ranks"]:
            for shard_idx, g0, g1 in runs:
                name = plan["shards"][shard_idx]
                groups = set(range(g0, g1))
                assert not (seen.setdefault(name, set()) & groups), f"{name} groups read twice"
                seen[name] |= groups
    assert json.loads((run / "STATUS.json").read_text())["state"] == "completed"


@pytest.mark.integration
def test_trainer_stops_on_sigterm_while_waiting_for_samples(tmp_path: Path) -> None:
    """Every rollout worker is gone (a detached local run has no supervisor to restart them) and the trainer waits
    for samples; SIGTERM (a preemption) must end that wait: the trainer checkpoints its last step and exits at once,
    instead of waiting out ``store.wait_timeout_s``."""
    run = tmp_path / "run"
    pids = _start(run, "--set", "num_steps=400", "--set", "warmup.steps=0", "--set", "trainer.checkpoint_every=1000")
    try:
        _wait_steps(run, 3)
        for name in ("rollout-0", "rollout-1"):
            os.kill(pids[name], signal.SIGKILL)
            _wait_exit(pids[name])
        time.sleep(3.0)  # the backlog is drained: the trainer now waits for samples that will not come
        step = len(rewards(run, "trainer-0"))
        os.kill(pids["trainer-0"], signal.SIGTERM)
        _wait_exit(pids["trainer-0"], timeout=60)
    finally:
        for pid in pids.values():
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
    assert step < 400
    newest = latest_checkpoint(RunDir(run))  # the truth; LATEST lags it when the kill fell between the two moves
    assert newest is not None
    ckpt = int(newest.name.removeprefix("step_"))
    assert ckpt == len(rewards(run, "trainer-0")) >= step  # the steps it finished, checkpointed on the signal
