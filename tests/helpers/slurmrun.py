"""Helpers of the Slurm tier: submit the small demo to the real cluster, wait on its jobs, read its records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_hpc.fsio import read_json
from relax_hpc.launch import slurm_cli
from relax_hpc.launch.slurm import read_launch_record
from relax_hpc.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "recipes" / "demo.yaml"
# The demo, made small enough for a shared 2-core machine: no warm-up, small batches, checkpoint every step.
SMALL = ["warmup.steps=0", "rollout.prompts_per_step=4", "rollout.n_samples=4", "rollout.batch_prompts=4",
         "trainer.checkpoint_every=1", "launch.time_min=30", "launch.signal_delay_s=60"]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RELAX_HPC_PYTHON", None)
    return subprocess.run([sys.executable, "-m", "relax_hpc", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def submit(rd_path: Path, *sets: str, runs: list[RunDir]) -> RunDir:
    args = ["submit", str(DEMO), "--executor", "slurm", "--run-dir", str(rd_path)]
    for s in [*SMALL, *sets]:
        args += ["--set", s]
    res = cli(*args)
    assert res.returncode == 0, res.stderr
    rd = RunDir(rd_path)
    runs.append(rd)
    return rd


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float) -> Any:
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(1.0)


def during_run(rd: RunDir, predicate: Callable[[], Any], what: str, timeout_s: float) -> Any:
    """Wait for ``predicate`` while the run's jobs are still active; failing early, with the logs, if they end."""
    def check() -> Any:
        value = predicate()
        if value:
            return value
        if not active(rd):
            value = predicate()
            assert value, f"the run ended before {what}:{output_tails(rd)}"
        return value
    return wait_until(check, what, timeout_s)


def output_tails(rd: RunDir) -> str:
    tail = ""
    for out in sorted(rd.slurm.glob("*.out")):
        tail += f"\n--- {out.name}\n" + "\n".join(out.read_text().splitlines()[-15:])
    return tail


def active(rd: RunDir) -> bool:
    ids = [e["job_id"] for e in read_launch_record(rd)["jobs"]]
    q = slurm_cli.query_jobs(ids, use_sacct=False)
    return any(r.active for j in ids for r in q.of(j))


def records(rd: RunDir, proc: str, kind: str | None = None, event: str | None = None) -> list[dict[str, Any]]:
    path = rd.event_log(proc)
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if (kind is None or rec.get("kind") == kind) and (event is None or rec.get("event") == event):
            out.append(rec)
    return out


def trainer_steps(rd: RunDir, proc: str = "trainer-0") -> list[int]:
    return [r["step"] for r in records(rd, proc, "metrics") if r.get("step") and "rollout/reward" in r["metrics"]]


def finished_ok(rd: RunDir, timeout_s: float) -> None:
    wait_until(lambda: not active(rd), "the run's jobs to end", timeout_s)
    final = read_json(rd.status_file, default=None)
    assert isinstance(final, dict) and final.get("state") == "completed", output_tails(rd)
