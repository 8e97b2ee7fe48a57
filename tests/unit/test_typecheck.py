"""The core type-checks: mypy (config in pyproject.toml, pydantic's plugin) over the run-dir protocol, the store, the
engine and backend seams, the roles table and the config schema. A type error there fails the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORE = [
    "relax_hpc/rundir.py", "relax_hpc/fsio.py", "relax_hpc/lifecycle.py", "relax_hpc/store",
    "relax_hpc/rollout/engine.py", "relax_hpc/rollout/driver.py", "relax_hpc/rollout/hf_engine.py",
    "relax_hpc/rollout/slots.py", "relax_hpc/rollout/partial.py", "relax_hpc/bench/lengths.py",
    "relax_hpc/trainer/backend.py", "relax_hpc/roles", "relax_hpc/config", "relax_hpc/modes",
    "relax_hpc/weights/fastpath.py", "relax_hpc/weights/server_links.py", "relax_hpc/weights/transport",
    "relax_hpc/trainer/gpu_checkpoint.py", "relax_hpc/trainer/session.py", "relax_hpc/launch/checks.py",
    "relax_hpc/launch/preflight.py", "relax_hpc/weights/vllm_transfer.py", "relax_hpc/rollout/factory.py",
]


def test_core_type_checks() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy", *CORE], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Success" in proc.stdout
