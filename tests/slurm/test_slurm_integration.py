"""End to end on a real Slurm cluster with the real roles (tiny model on CPU): the demo in hetjob and in separate
placement, elastic scale-up/down mid-run, a trainer requeued by ``scontrol requeue`` that resumes from its
checkpoint, cancel + resume, and a sweep as one job array.

Needs tools/slurm_local.sh start; skipped without a cluster unless RELAX_REQUIRE_SLURM=1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_hpc.errors import UserError
from relax_hpc.fsio import read_json
from relax_hpc.launch import slurm_cli
from relax_hpc.launch.slurm import read_launch_record
from relax_hpc.rundir import RunDir
from tests.helpers.slurmrun import (  # noqa: F401
    DEMO,
    ROOT,
    SMALL,
    active,
    cli,
    during_run,
    finished_ok,
    output_tails,
    records,
    submit,
    trainer_steps,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.integration, pytest.mark.slow]
def test_demo_hetjob(submitted: list[RunDir], tmp_path: Path) -> None:
    rd = submit(tmp_path / "het run", "mode=fully_async", "launch.placement=hetjob", "num_steps=3",
                runs=submitted)
    (job,) = read_launch_record(rd)["jobs"]
    assert job["kind"] == "hetjob"
    finished_ok(rd, 600)
    assert trainer_steps(rd)[-1] == 3
    het = {r["proc"]: r.get("slurm_job_id") for r in records(rd, "rollout-0", "event", "started")
           + records(rd, "rollout-1", "event", "started") + records(rd, "trainer-0", "event", "started")}
    assert set(het) == {"trainer-0", "rollout-0", "rollout-1"}
    st = json.loads(cli("status", str(rd.root), "--json").stdout)
    assert st["state"] == "completed"


def test_demo_separate_scaled_up_and_down_mid_run(submitted: list[RunDir], tmp_path: Path) -> None:
    steps = 800  # long enough that the trainer still trains after the new workers started and were drained (also on
    # a machine faster than the 2-core VM: the Slurm and start-up overheads do not shrink with the steps)
    rd = submit(tmp_path / "sep", "mode=fully_async", "launch.placement=separate", f"num_steps={steps}",
                "rollout.num_workers=1", runs=submitted)
    assert [j["kind"] for j in read_launch_record(rd)["jobs"]] == ["trainer", "rollout_array"]
    during_run(rd, lambda: trainer_steps(rd), "a first trainer step", 600)
    res = cli("scale", str(rd.root), "--rollout", "3")
    assert res.returncode == 0 and "added ranks [1, 2]" in res.stdout, res.stderr
    during_run(rd, lambda: records(rd, "rollout-2", "metrics") and records(rd, "rollout-1", "metrics"),
               "the new workers to produce samples", 600)
    res = cli("scale", str(rd.root), "--rollout", "1", "--timeout", "300")
    assert res.returncode == 0 and "drained ranks [2, 1]" in res.stdout, res.stdout + res.stderr
    assert records(rd, "rollout-2", "event", "stopped") and records(rd, "rollout-1", "event", "stopped")
    assert read_json(rd.heartbeat("rollout-2"))["state"] == "stopped"
    at_drain = trainer_steps(rd)[-1]
    assert at_drain < steps, "the trainer should still be training"
    st = json.loads(cli("status", str(rd.root), "--json").stdout)
    assert {r["proc"] for r in st["roles"] if r["retired"]} == {"rollout-1", "rollout-2"}
    finished_ok(rd, 900)
    assert trainer_steps(rd)[-1] == steps
    # rank 0 kept producing after the drain: some samples were made at a version newer than the drain step
    assert max(r["metrics"]["rollout/version"] for r in records(rd, "rollout-0", "metrics")) > at_drain


def test_trainer_requeued_by_scontrol_resumes(submitted: list[RunDir], tmp_path: Path) -> None:
    steps_total = 300  # long enough to still run when the requeue lands (a demo step here takes well under 1 s)
    rd = submit(tmp_path / "rq", f"num_steps={steps_total}", runs=submitted)
    (job,) = read_launch_record(rd)["jobs"]
    during_run(rd, lambda: len(trainer_steps(rd, "colocate-0")) >= 2, "two steps", 600)

    def requeue() -> bool:
        try:
            slurm_cli.requeue(job["job_id"])
        except UserError:
            return False
        return True
    wait_until(requeue, "scontrol requeue to be accepted", 30)
    finished_ok(rd, 900)
    preempted = records(rd, "colocate-0", "event", "preempted")
    assert preempted, "the trainer should have checkpointed on SIGTERM"
    ckpt = preempted[0]["step"]
    steps = trainer_steps(rd, "colocate-0")
    assert steps[-1] == steps_total and 2 <= ckpt < steps_total
    restarted = [r for r in records(rd, "colocate-0", "event", "started") if r.get("slurm_restart_count") == "1"]
    assert restarted, "the job should have run again with SLURM_RESTART_COUNT=1"
    after = [s for s in steps if s > ckpt]
    assert after and after[0] == ckpt + 1 and steps.count(1) == 1, steps  # resumed, not restarted


def test_cancel_then_resume(submitted: list[RunDir], tmp_path: Path) -> None:
    rd = submit(tmp_path / "cr", "num_steps=400", runs=submitted)  # long enough to still run when cancelled
    during_run(rd, lambda: trainer_steps(rd, "colocate-0"), "a first step", 600)
    res = cli("cancel", str(rd.root), "--timeout", "120")
    assert res.returncode == 0 and "cancelled Slurm job" in res.stdout, res.stderr
    assert not active(rd)
    res = cli("resume", str(rd.root))
    assert res.returncode == 0 and "submitted job" in res.stdout, res.stderr
    finished_ok(rd, 900)
    steps = trainer_steps(rd, "colocate-0")
    assert steps[-1] == 400 and steps.count(1) == 1, steps
    assert len(read_launch_record(rd)["history"]) == 1


def test_sweep_job_array(cluster: None, tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    args = ["sweep", str(DEMO), "--grid", "trainer.lr=1e-3,3e-3", "--parallel", "2", "--sweep-dir", str(sweep_dir),
            "--executor", "slurm"]
    for s in [*SMALL, "num_steps=2"]:
        args += ["--set", s]
    res = cli(*args)
    assert res.returncode == 0, res.stderr
    aid = read_json(sweep_dir / "launch.json")["array_job_id"]
    try:
        wait_until(lambda: not any(r.active for r in slurm_cli.query_jobs([aid], use_sacct=False).of(aid)),
                   "the sweep's job array to end", 900)
        st = json.loads(cli("sweep-status", str(sweep_dir), "--json").stdout)
        assert [(r["state"], r["step"]) for r in st["runs"]] == [("completed", 2), ("completed", 2)]
        assert all("rollout/reward" in r["metrics"] for r in st["runs"])
        table = cli("sweep-status", str(sweep_dir)).stdout
        assert "1e-3" in table and "3e-3" in table and "completed" in table
    finally:
        slurm_cli.scancel([aid])
