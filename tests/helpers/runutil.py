"""Shared test helpers: run the CLI as a real process, read a run's metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo.yaml"


def cli(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m relax_hpc ARGS`` as a subprocess (the way users run it)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "relax_hpc", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=REPO)


def submit_detached(recipe: Path, run: Path, *args: str) -> int:
    """``relax-hpc submit RECIPE --executor local --detach``: the run started in the background; the pid of its
    first process (the colocate process of a colocate run)."""
    proc = cli("submit", str(recipe), "--executor", "local", "--run-dir", str(run), "--detach", *args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(json.loads((run / "launch.json").read_text())["procs"][0]["pid"])


def sigterm_when(pid: int, ready: Callable[[], bool], *, timeout_s: float = 300, exit_timeout_s: float = 120) -> None:
    """SIGTERM ``pid`` once ``ready()`` (polled every 0.1 s; at ``timeout_s`` anyway), then wait for it to end;
    AssertionError if it is still alive ``exit_timeout_s`` after the signal."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and not ready():
        time.sleep(0.1)
    os.kill(pid, signal.SIGTERM)
    wait_exit(pid, exit_timeout_s)


def wait_exit(pid: int, timeout_s: float) -> None:
    """Wait for process ``pid`` to end (polled every 0.1 s); AssertionError if it still runs after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} still running after {timeout_s:.0f} s")


def metrics(run_dir: Path, proc: str) -> list[dict[str, Any]]:
    """Metric records of one process, in file order."""
    path = run_dir / "logs" / "events" / f"{proc}.jsonl"
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "metrics":
            out.append(rec)
    return out


def rewards(run_dir: Path, proc: str) -> list[float]:
    return [r["metrics"]["rollout/reward"] for r in metrics(run_dir, proc) if "rollout/reward" in r["metrics"]]


def events(run_dir: Path, proc: str) -> list[dict[str, Any]]:
    path = run_dir / "logs" / "events" / f"{proc}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steps_around_restart(run_dir: Path, proc: str, killed_pid: int) -> tuple[list[int], list[int]]:
    """The training steps ``proc`` logged (records with ``rollout/reward``) before its process ``killed_pid`` was
    killed, and after it was restarted, told apart by the records' ``pid`` (a restart that begins right after the
    last logged step leaves no drop in the step numbers to find it by)."""
    recs = [r for r in metrics(run_dir, proc) if "rollout/reward" in r["metrics"]]
    return ([r["step"] for r in recs if r.get("pid") == killed_pid],
            [r["step"] for r in recs if r.get("pid") != killed_pid])


def torchrun_colocate_preempted(run: Path, sets: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """The demo's run dir with ``sets`` (a dry-run submit: nothing starts), then its colocate role as two ranks
    under ``relax_hpc.launch.torchrun``; once two steps are logged, a SIGUSR2 (Slurm's time-limit warning), and the
    launcher must exit 3 (requeue). Returns the finished launcher."""
    import signal
    import time

    prep = cli("submit", str(DEMO), "--executor", "local", "--dry-run", "--run-dir", str(run),
               *[a for s in sets for a in ("--set", s)])
    assert prep.returncode == 0, prep.stderr[-2000:]
    p = torchrun_colocate(run, env)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        if (run / "logs/events/colocate-0.jsonl").exists() and len(metrics(run, "colocate-0")) >= 2:
            break
        time.sleep(0.2)
    assert p.poll() is None, p.stderr.read()[-3000:] if p.stderr else ""
    p.send_signal(signal.SIGUSR2)
    assert p.wait(timeout=300) == 3, p.stderr.read()[-3000:] if p.stderr else ""
    return p


def torchrun_colocate(run: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """The run's colocate role as two ranks under ``relax_hpc.launch.torchrun --standalone`` (stderr piped). The
    ranks get 180 s after a forwarded signal (the sbatch scripts pass the recipe's signal delay; torchrun's own
    default of 30 s is shorter than a dist checkpoint of two ranks on a loaded 2-core machine)."""
    return subprocess.Popen([sys.executable, "-m", "relax_hpc.launch.torchrun", "--standalone", "--nproc-per-node=2",
                             "--shutdown-timeout=180",
                             "-m", "relax_hpc", "role", "colocate", "--run-dir", str(run)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


# the demo on the vllm engine: one worker with one CPU server, the model shape vLLM's CPU backend takes
VLLM_DEMO = ["mode=fully_async", "rollout.engine=vllm", "rollout.device=cpu", "rollout.num_workers=1",
             "model.tiny.hidden_size=128", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
             "model.tiny.intermediate_size=256", "model.tiny.tie_embeddings=false"]
