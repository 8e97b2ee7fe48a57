"""The chaos tier on the local Slurm cluster: ``relax-hpc bench chaos`` (10 demo-sized fully_async runs of 24 steps,
>= 100 random SIGKILLs of the trainer and each rollout worker, random ``scontrol requeue`` and step ``scancel``s: fewer,
longer runs than the bench's default of 20 x 16 steps, the same number of kills).
Every run must complete, resumed when its jobs end without completing, and the store's accounting must show no
sample lost or consumed twice. Run alone with ``pytest -m chaos``; the tier takes about 5-8 minutes on a 2-core
machine (docs/benchmarks.md).

Needs tools/slurm_local.sh start; skipped without a cluster unless RELAX_REQUIRE_SLURM=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_hpc.launch import slurm_cli

pytestmark = [pytest.mark.chaos, pytest.mark.slurm, pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_chaos_tier(tmp_path: Path) -> None:
    from relax_hpc.bench.slurm import use_local_cluster

    use_local_cluster()
    problem = slurm_cli.slurm_problem(timeout_s=10)
    if problem is not None:
        if os.environ.get("RELAX_REQUIRE_SLURM") == "1":
            pytest.fail(f"no Slurm cluster answers ({problem})")
        pytest.skip(f"no Slurm cluster answers ({problem}); start one with: tools/slurm_local.sh start")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "relax_hpc", "bench", "chaos", "--json", "--runs", "10", "--steps", "24",
           "--kills", "100", "--base", str(tmp_path / "chaos"), "--timeout-s", "900"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1000)
    assert res.stdout.strip(), res.stderr[-3000:]
    out = json.loads(res.stdout)
    print(json.dumps({k: v for k, v in out.items() if k != "notes"}, indent=1))
    assert out["runs"] >= 10 and out["kills"] >= 100, out
    assert out["requeues"] + out["step_cancels"] > 0, out
    assert out["completed"] == out["runs"], out
    assert out["lost"] == 0 and out["duplicated"] == 0, out
    assert out["produced"] == out["consumed"] + out["dropped"] + out["quarantined"] + out["unread"], out
    # each kill is restarted in place, unless a requeue, a step cancel or the end of the run came first
    assert out["restarts"] >= out["kills"] - out["requeues"] - out["step_cancels"] - out["runs"], out
    assert not out["problems"], out["problems"]
    assert res.returncode == 0, res.stderr[-3000:]
