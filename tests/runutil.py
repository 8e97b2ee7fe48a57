"""Shared test helpers: run the CLI as a real process, read a run's metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "recipes" / "demo.yaml"


def cli(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m relax_hpc ARGS`` as a subprocess (the way users run it)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "relax_hpc", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=REPO)


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
