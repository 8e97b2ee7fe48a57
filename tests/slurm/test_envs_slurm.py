"""An agentic run on the real Slurm cluster: the tiny tool recipe in fully_async (trainer and a rollout worker as
Slurm jobs, episodes inside the worker's rollout driver) completes, and the episode metrics are in the metrics
records of the run's event logs (and shown by the monitor).

Needs tools/slurm_local.sh start; skipped without a cluster unless RELAX_REQUIRE_SLURM=1.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.envs.metrics import METRIC_NAMES
from relax_hpc.fsio import read_json
from relax_hpc.launch import slurm_cli
from relax_hpc.rundir import RunDir
from tests.helpers.slurmrun import SMALL, cli, finished_ok, records, trainer_steps

pytestmark = [pytest.mark.slurm, pytest.mark.integration, pytest.mark.slow]
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-digit-lookup-tool.yaml"


@pytest.fixture
def runs() -> Iterator[list[RunDir]]:
    """Run dirs whose recorded jobs are cancelled (by id) at teardown, whatever happened."""
    from relax_hpc.bench.slurm import use_local_cluster

    use_local_cluster()
    problem = slurm_cli.slurm_problem(timeout_s=10)
    if problem is not None:
        import os

        msg = f"no Slurm cluster answers ({problem}); start one with: tools/slurm_local.sh start"
        if os.environ.get("RELAX_REQUIRE_SLURM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    rds: list[RunDir] = []
    yield rds
    ids = [e["job_id"] for rd in rds for e in (read_json(rd.launch_record, default={}) or {}).get("jobs", [])]
    slurm_cli.scancel(ids)


def test_agentic_fully_async_on_slurm(runs: list[RunDir], tmp_path: Path) -> None:
    args = ["submit", str(RECIPE), "--executor", "slurm", "--run-dir", str(tmp_path / "run")]
    for s in [*SMALL, "warmup.steps=0", "mode=fully_async", "rollout.num_workers=1", "num_steps=4",
              "store.retention=keep"]:
        args += ["--set", s]
    res = cli(*args)
    assert res.returncode == 0, res.stderr
    rd = RunDir(tmp_path / "run")
    runs.append(rd)
    finished_ok(rd, 900)
    assert trainer_steps(rd)[-1] == 4
    started = records(rd, "rollout-0", "event", "started")
    assert started and all(r.get("slurm_job_id") for r in started)  # the worker ran as a Slurm job
    agent = [r["metrics"] for r in records(rd, "rollout-0", "metrics") if "agent/episodes" in r["metrics"]]
    assert agent, "no agent/* metrics in the rollout worker's metrics records"
    for m in agent:
        assert set(METRIC_NAMES) <= set(m)
        assert m["agent/episodes"] > 0 and m["agent/episodes"] % 4 == 0  # whole groups of n_samples=4
        assert m["agent/turns_per_episode"] >= 1 and np.isfinite(m["agent/episode_reward"])
    snap = json.loads(cli("monitor", str(rd.root), "--json").stdout)
    assert snap["turns"] >= 1 and snap["tool_calls"] is not None and snap["episode_reward"] is not None
    trainer = [r["metrics"] for r in records(rd, "trainer-0", "metrics") if "agent/episodes" in r["metrics"]]
    assert len(trainer) == 4 and all(m["agent/episodes"] == 16 for m in trainer)  # 4 prompts x 4 per step
    print(json.dumps({"slurm_job_ids": sorted({r["slurm_job_id"] for r in started}), "trainer_agent_metrics":
                      {k: round(v, 3) for k, v in trainer[-1].items() if k.startswith("agent/")}}))
