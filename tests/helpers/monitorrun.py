"""Run dirs written by real role processes, for the monitor tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from relax_hpc.fsio import atomic_write_json
from relax_hpc.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]

ROLE = """
import json, sys
from relax_hpc.rundir import RunDir
from relax_hpc.events import EventLog, Heartbeat
rd = RunDir.open(sys.argv[1])
spec = json.loads(sys.argv[2])
log = EventLog(rd, spec["role"], spec["rank"])
hb = Heartbeat(rd, spec["role"], spec["rank"])
for step, metrics in spec.get("metrics", []):
    log.metrics(metrics, step=step)
for ev in spec.get("events", []):
    log.event(ev["event"], ev.get("message", ""), level=ev.get("level", "info"))
hb.beat(state=spec.get("state", "running"), step=spec.get("step"), version=spec.get("version"), force=True)
log.close()
"""


def role_process(rd: RunDir, env: dict[str, str] | None = None, **spec: Any) -> None:
    """Run one role as its own process: it writes its event log and heartbeat, then exits."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    subprocess.run([sys.executable, "-c", ROLE, str(rd.root), json.dumps(spec)], env=full_env, check=True,
                   timeout=120)


def trainer_metrics(step: int, loss: float = 0.5) -> dict[str, float]:
    return {"rollout/reward": 0.1 * step, "train/loss": loss, "train/kl_loss": 0.01, "train/entropy_loss": 1.5,
            "train/pg_clipfrac": 0.02, "rollout/response_length": 42.0, "perf/samples_per_s": 12.5,
            "perf/tokens_per_s": 3000.0, "rollout/staleness_mean": 0.5, "store/backlog_samples": 64,
            "weights/version": step}


def make_run(root: Path, *, name: str = "demo", num_steps: int = 10, steps: int = 5,
             monitor: dict[str, Any] | None = None) -> RunDir:
    rd = RunDir.create(root, name=name)
    atomic_write_json(rd.config, {"name": name, "mode": "fully_async", "num_steps": num_steps,
                                  "monitor": monitor or {"dead_after_s": 120}})
    return rd
