"""Slurm plumbing on a real cluster (tools/slurm_local.sh start), with a stand-in role program.

The sbatch scripts, placements, array ranks, signals, requeues, scaling, cancel, status and sweeps run for real;
the roles are replaced by ``test_slurm_standin.py`` (same command line and exit-code contract) so each test takes
seconds. The same flows with the real roles are in ``test_slurm_integration.py``.

Skipped when no cluster answers, unless RELAX_REQUIRE_SLURM=1 (CI), where that is a failure.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.bench.slurm import use_local_cluster
from relax_hpc.config.load import config_to_json, validate_dict
from relax_hpc.errors import UserError
from relax_hpc.fsio import atomic_write_json, read_json
from relax_hpc.launch import slurm_cli
from relax_hpc.launch.runctl import cancel_run, run_status
from relax_hpc.launch.slurm import launch, read_launch_record
from relax_hpc.launch.slurm_scale import scale_rollout
from relax_hpc.rundir import RunDir

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def slurm() -> None:
    use_local_cluster()  # SLURM_CONF of tools/slurm_local.sh's cluster, when unset
    problem = slurm_cli.slurm_problem(timeout_s=10)
    if problem is None:
        return
    msg = f"no Slurm cluster answers ({problem}); start one with: tools/slurm_local.sh start"
    if os.environ.get("RELAX_REQUIRE_SLURM") == "1":
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture
def standin(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An executable the scripts use as their interpreter: it runs test_slurm_standin.py instead of the roles."""
    path = tmp_path_factory.mktemp("standin") / "standin-python"
    program = Path(__file__).resolve().parent / "test_slurm_standin.py"
    path.write_text(f"#!/bin/bash\nexport PYTHONPATH={shlex.quote(str(ROOT))}\n"
                    f"exec {shlex.quote(sys.executable)} {shlex.quote(str(program))} \"$@\"\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def runs(slurm: None, tmp_path: Path) -> Iterator[Callable[..., tuple[RunDir, Any]]]:
    """Make run dirs (recipe dict + overrides -> config.json); cancel every job they recorded at teardown."""
    made: list[RunDir] = []

    def make(name: str = "run", **over: Any) -> tuple[RunDir, Any]:
        data: dict[str, Any] = {"name": "t", "mode": "colocate", "num_steps": 6,
                                "data": {"task": {"name": "reverse_digits"}},
                                "rollout": {"num_workers": 2}, "launch": {"time_min": 10, "signal_delay_s": 30}}
        for key, value in over.items():
            node = data
            *parents, last = key.split("__")
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = value
        cfg = validate_dict(data)
        rd = RunDir.create(tmp_path / name, name=cfg.name)
        atomic_write_json(rd.config, config_to_json(cfg))
        made.append(rd)
        return rd, cfg

    yield make
    ids = []
    for rd in made:
        rec = read_json(rd.launch_record, default={}) or {}
        ids += [e["job_id"] for e in rec.get("jobs", [])]
    slurm_cli.scancel(ids)


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)


def jobs_done(rd: RunDir) -> bool:
    ids = [e["job_id"] for e in read_launch_record(rd)["jobs"]]
    q = slurm_cli.query_jobs(ids, use_sacct=False)
    return not any(r.active for j in ids for r in q.of(j))


def final_states(rd: RunDir) -> dict[str, str]:
    """Accounting states of the run's jobs (sacct can lag the end of a job by a second)."""
    ids = [e["job_id"] for e in read_launch_record(rd)["jobs"]]

    def get() -> dict[str, str] | None:
        q = slurm_cli.query_jobs(ids)
        rows = {r.job_id: f"{r.state.split()[0]} {r.exit_code}" for j in ids for r in q.of(j)}
        return rows if rows and all(r.source == "sacct" for j in ids for r in q.of(j)) else None
    return wait_until(get, "sacct to list the ended jobs", 30)


def events(rd: RunDir, proc: str, name: str | None = None) -> list[dict[str, Any]]:
    path = rd.event_log(proc)
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in recs if name is None or r.get("event") == name]


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relax_hpc", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


# ------------------------------------------------------------------------------------------------ placements
def test_hetjob_in_a_weird_run_dir(runs: Callable[..., Any], standin: str) -> None:
    """ONE heterogeneous job: trainer and rollout groups start together, each its own step; odd path intact."""
    rd, cfg = runs("it's a \"run\" $HOME; echo #1", mode="fully_async", launch__placement="hetjob")
    rec = launch(rd, cfg, python=standin)
    (job,) = rec["jobs"]
    assert job["kind"] == "hetjob" and job["roles"] == ["trainer", "rollout"]
    wait_until(lambda: jobs_done(rd), "the hetjob to end", 90)
    assert read_json(rd.status_file)["state"] == "completed"
    assert set(final_states(rd).values()) == {"COMPLETED 0:0"}
    (trainer,) = events(rd, "trainer-0", "incarnation")
    assert trainer["ntasks"] == "1" and trainer["slurm_job_id"] == job["job_id"]
    for r in (0, 1):
        (inc,) = events(rd, f"rollout-{r}", "incarnation")
        assert inc["ntasks"] == "2"  # both workers are tasks of the one rollout het-group step
        assert events(rd, f"rollout-{r}", "done")
    out = rd.slurm_output("hetjob", job["job_id"])
    assert out.is_file() and "trainer step ended with exit status 0" in out.read_text()


def test_hetjob_fails_when_the_rollout_group_fails(runs: Callable[..., Any], standin: str) -> None:
    """A failed rollout group would leave the trainer without samples: the script stops it and fails the job."""
    rd, cfg = runs(mode="fully_async", num_steps=400, launch__placement="hetjob",
                   launch__rollout__env={"STANDIN_ROLLOUT_FAIL": "1"})
    job_id = launch(rd, cfg, python=standin)["jobs"][0]["job_id"]
    wait_until(lambda: jobs_done(rd), "the hetjob to end", 90)
    assert events(rd, "rollout-0", "failing") and events(rd, "rollout-1", "failing")  # role env reached the step
    assert events(rd, "trainer-0", "checkpointed")[0]["signal"] == "SIGUSR2"
    assert not events(rd, "trainer-0", "failing")  # the trainer's step did not get the rollout's env
    assert set(final_states(rd).values()) == {"FAILED 1:0"}
    assert "the rollout workers failed" in rd.slurm_output("hetjob", job_id).read_text()


def test_separate_placement_status_scale_and_cancel(runs: Callable[..., Any], standin: str) -> None:
    rd, cfg = runs(mode="fully_async", num_steps=400, launch__placement="separate", rollout__num_workers=2)
    rec = launch(rd, cfg, python=standin)
    assert [j["kind"] for j in rec["jobs"]] == ["trainer", "rollout_array"]
    assert rec["jobs"][1]["ranks"] == [0, 1]
    wait_until(lambda: events(rd, "rollout-0", "incarnation") and events(rd, "rollout-1", "incarnation")
               and events(rd, "trainer-0", "incarnation"), "trainer and both workers to start")
    for r in (0, 1):  # rank = array task id
        inc = events(rd, f"rollout-{r}", "incarnation")[0]
        assert inc["slurm_array_task_id"] == str(r) and inc["argv"][-2:] == ["--rank", str(r)]

    st = run_status(rd)
    states = {s["id"]: s["state"] for j in st["jobs"] for s in j["states"]}
    array_id = rec["jobs"][1]["job_id"]
    assert states[f"{array_id}_0"] == "RUNNING" and states[f"{array_id}_1"] == "RUNNING"
    assert st["state"] == "running" and {r["proc"] for r in st["roles"]} >= {"trainer-0", "rollout-0", "rollout-1"}

    up = scale_rollout(rd, 4, python=standin)
    assert up["added"] == [2, 3]
    wait_until(lambda: events(rd, "rollout-2", "incarnation") and events(rd, "rollout-3", "incarnation"),
               "the added workers to start")
    assert events(rd, "rollout-2", "incarnation")[0]["slurm_array_job_id"] == up["jobs"][0]

    down = scale_rollout(rd, 1, timeout_s=60)
    assert sorted(down["drained"]) == [1, 2, 3] and down["cancelled"] == []
    for r in (1, 2, 3):
        assert events(rd, f"rollout-{r}", "drained")
    assert not events(rd, "rollout-0", "drained") and read_launch_record(rd)["retired"] == [1, 2, 3]
    assert not rd.status_file.exists()  # training went on

    out = cancel_run(rd, timeout_s=60)
    assert set(out["cancelled_jobs"]) == {rec["jobs"][0]["job_id"], array_id}
    assert not out["still_active"]
    assert events(rd, "trainer-0", "checkpointed")[-1]["signal"] == "SIGTERM"
    states = final_states(rd)
    assert states[rec["jobs"][0]["job_id"]].startswith("CANCELLED")


# ------------------------------------------------------------------------------------------------ preemption
def test_usr2_before_the_limit_requeues_and_resumes(runs: Callable[..., Any], standin: str) -> None:
    """What Slurm does signal_delay_s before the limit: USR2 to the steps -> checkpoint, exit 3 -> requeue."""
    rd, cfg = runs(num_steps=16)  # 0.5 s a step: ~7 s left after step 2 for the signal to land
    job_id = launch(rd, cfg, python=standin)["jobs"][0]["job_id"]
    wait_until(lambda: rd.checkpoints_latest.exists() and int(rd.checkpoints_latest.read_text()) >= 2,
               "two steps")
    slurm_cli.scancel([job_id], signal="USR2")  # to the job's steps, as --signal=USR2@T does
    wait_until(lambda: rd.status_file.exists() and jobs_done(rd), "the requeued job to finish", 120)
    first, second = events(rd, "colocate-0", "incarnation")
    assert first["resumed_from"] == 0 and second["resumed_from"] >= 2
    assert second["slurm_restart_count"] == "1" and second["slurm_job_id"] == job_id
    assert events(rd, "colocate-0", "checkpointed")[0]["signal"] == "SIGUSR2"
    assert final_states(rd) == {job_id: "COMPLETED 0:0"}
    assert "requeueing job" in rd.slurm_output("colocate", job_id).read_text()


@pytest.mark.slow
def test_time_limit_signal_from_slurm_requeues(runs: Callable[..., Any], standin: str) -> None:
    """The real thing: --signal=USR2@50 with a 1-minute limit; slurmctld signals the steps, the job requeues."""
    rd, cfg = runs(num_steps=10_000, launch__time_min=1, launch__signal_delay_s=50)
    job_id = launch(rd, cfg, python=standin)["jobs"][0]["job_id"]
    second = wait_until(lambda: events(rd, "colocate-0", "incarnation")[1:], "a second incarnation", 150)[0]
    assert second["slurm_restart_count"] == "1" and second["resumed_from"] > 0
    assert events(rd, "colocate-0", "checkpointed")[0]["signal"] == "SIGUSR2"
    assert "requeueing job" in rd.slurm_output("colocate", job_id).read_text()
    cancel_run(rd, timeout_s=60)


def test_external_scontrol_requeue_resumes(runs: Callable[..., Any], standin: str) -> None:
    """``scontrol requeue`` (SIGTERM to the steps): the trainer checkpoints, Slurm reruns the job, it resumes."""
    rd, cfg = runs(num_steps=16, mode="fully_async", launch__placement="separate", rollout__num_workers=1)
    trainer_job = launch(rd, cfg, python=standin)["jobs"][0]["job_id"]
    wait_until(lambda: rd.checkpoints_latest.exists() and int(rd.checkpoints_latest.read_text()) >= 2,
               "two steps")
    wait_until(lambda: _try_requeue(trainer_job), "scontrol requeue to be accepted", 20)
    wait_until(lambda: rd.status_file.exists() and jobs_done(rd), "the run to finish", 120)
    _first, second = events(rd, "trainer-0", "incarnation")
    assert second["resumed_from"] >= 2 and second["slurm_restart_count"] == "1"
    assert events(rd, "trainer-0", "checkpointed")[0]["signal"] == "SIGTERM"
    assert final_states(rd)[trainer_job] == "COMPLETED 0:0"


def _try_requeue(job_id: str) -> bool:
    try:
        slurm_cli.requeue(job_id)
    except UserError:  # "Job is pending execution" right after a start: retry
        return False
    return True


def test_max_requeues_reached_fails_the_job(runs: Callable[..., Any], standin: str) -> None:
    rd, cfg = runs(num_steps=40, launch__max_requeues=0)
    job_id = launch(rd, cfg, python=standin)["jobs"][0]["job_id"]
    wait_until(lambda: rd.checkpoints_latest.exists(), "a first step")
    slurm_cli.scancel([job_id], signal="USR2")
    wait_until(lambda: jobs_done(rd), "the job to end", 60)
    assert final_states(rd) == {job_id: "FAILED 3:0"}
    assert "launch.max_requeues=0" in rd.slurm_output("colocate", job_id).read_text()
    assert len(events(rd, "colocate-0", "incarnation")) == 1


# ------------------------------------------------------------------------------------------------ errors, CLI
def test_sbatch_rejection_is_one_line(runs: Callable[..., Any], standin: str) -> None:
    rd, cfg = runs(launch__partition="nosuchpartition")
    with pytest.raises(UserError) as err:
        launch(rd, cfg, python=standin)
    assert "sbatch rejected colocate.sbatch" in str(err.value) and "partition" in str(err.value).lower()
    assert "\n" not in str(err.value)
    assert not rd.launch_record.exists()


def test_separate_second_rejection_cancels_the_first(runs: Callable[..., Any], standin: str) -> None:
    rd, cfg = runs(mode="fully_async", launch__placement="separate",
                   launch__rollout__partition="nosuchpartition")
    before = set(slurm_cli.run_slurm(["squeue", "-h", "-o", "%i"]).stdout.split())
    with pytest.raises(UserError, match=r"sbatch rejected rollout-0-1\.sbatch"):
        launch(rd, cfg, python=standin)
    time.sleep(0.5)
    q = slurm_cli.run_slurm(["squeue", "-h", "-o", "%i|%j|%T"]).stdout.splitlines()
    ours = [line for line in q if line.split("|")[0] not in before and line.split("|")[1] == "t-trainer"]
    assert all(line.endswith("CANCELLED") or "COMPLET" in line for line in ours), ours


def test_cli_status_resume_and_cancel(runs: Callable[..., Any], standin: str) -> None:
    rd, cfg = runs(num_steps=300)
    launch(rd, cfg, python=standin)
    wait_until(lambda: events(rd, "colocate-0", "incarnation"), "the role to start")
    res = cli("resume", str(rd.root))
    assert res.returncode == 2 and "still active" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = cli("status", str(rd.root), "--json")
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["state"] == "running" and st["jobs"][0]["states"][0]["state"] == "RUNNING"
    res = cli("status", str(rd.root))
    assert "RUNNING" in res.stdout and "colocate-0" in res.stdout
    res = cli("cancel", str(rd.root), "--timeout", "60")
    assert res.returncode == 0 and "cancelled Slurm job" in res.stdout, res.stderr
    step = int(rd.checkpoints_latest.read_text())
    res = cli("resume", str(rd.root), env={"RELAX_HPC_PYTHON": standin})
    assert res.returncode == 0 and "submitted job" in res.stdout, res.stderr
    rec = read_launch_record(rd)
    assert len(rec["history"]) == 1
    wait_until(lambda: events(rd, "colocate-0", "incarnation")[1:], "the resumed role")
    assert events(rd, "colocate-0", "incarnation")[1]["resumed_from"] == step
    cancel_run(rd, timeout_s=60)


def test_status_of_64_rollout_jobs_is_fast(runs: Callable[..., Any]) -> None:
    """64 recorded rollout jobs, 64 heartbeats: `relax-hpc status` (a whole CLI process) stays under 1 s."""
    from relax_hpc.bench.slurm import held_array, status_fixture

    rd, _ = runs(mode="fully_async", launch__placement="separate", rollout__num_workers=64)
    array_id = held_array(64)
    try:
        status_fixture(rd, array_id, 64)
        cli("status", str(rd.root))  # warm the page cache
        t0 = time.perf_counter()
        res = cli("status", str(rd.root), "--json")
        took = time.perf_counter() - t0
        assert res.returncode == 0, res.stderr
        st = json.loads(res.stdout)
        assert sum(len(j["states"]) for j in st["jobs"]) == 64 and len(st["roles"]) == 64
        assert took < 1.0, f"status took {took:.2f}s"
    finally:
        slurm_cli.scancel([array_id])


# ------------------------------------------------------------------------------------------------ sweeps
def test_sweep_is_one_job_array(slurm: None, standin: str, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: sw\nmode: colocate\nnum_steps: 3\ndata: {task: {name: reverse_digits}}\n"
                      "launch: {time_min: 10, signal_delay_s: 30}\n")
    sweep_dir = tmp_path / "my sweep"
    res = cli("sweep", str(recipe), "--grid", "trainer.lr=1e-6,3e-6", "--grid", "algorithm.clip_high=0.2,0.28",
              "--parallel", "2", "--sweep-dir", str(sweep_dir), "--executor", "slurm",
              env={"RELAX_HPC_PYTHON": standin})
    assert res.returncode == 0, res.stderr
    manifest = read_json(sweep_dir / "sweep.json")
    record = read_json(sweep_dir / "launch.json")
    try:
        assert len(manifest["runs"]) == 4 and "submitted job array" in res.stdout
        text = (sweep_dir / "slurm" / "sweep.sbatch").read_text()
        assert "#SBATCH --array=0-3%2\n" in text
        aid = record["array_job_id"]
        wait_until(lambda: not any(r.active for r in slurm_cli.query_jobs([aid], use_sacct=False).of(aid)),
                   "the job array to end", 120)
        assert all((Path(r["run_dir"]) / "STATUS.json").exists() for r in manifest["runs"])
        res = cli("sweep-status", str(sweep_dir), "--json")
        st = json.loads(res.stdout)
        got = {tuple(r["overrides"]): (r["state"], r["step"], round(r["metrics"]["rollout/reward"], 4))
               for r in st["runs"]}
        for lr in ("1e-6", "3e-6"):
            for ch in ("0.2", "0.28"):
                want = round(float(ch) * 10 + float(lr) * 1e5 + 0.03, 4)
                assert got[(f"trainer.lr={lr}", f"algorithm.clip_high={ch}")] == ("completed", 3, want)
        table = cli("sweep-status", str(sweep_dir)).stdout
        assert "lr" in table.splitlines()[0] and "clip_high" in table.splitlines()[0] and "completed" in table
        tasks = {inc["slurm_array_task_id"] for r in manifest["runs"]
                 for inc in events(RunDir(r["run_dir"]), "colocate-0", "incarnation")}
        assert tasks == {"0", "1", "2", "3"}
        status = run_status(manifest["runs"][2]["run_dir"])  # a sweep run is a normal run dir
        assert status["jobs"][0]["job_id"] == f"{record['array_job_id']}_2"
    finally:
        slurm_cli.scancel([record["array_job_id"]])


def test_cancel_a_sweep(slurm: None, standin: str, tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: sw\nmode: colocate\nnum_steps: 1000\ndata: {task: {name: reverse_digits}}\n"
                      "launch: {time_min: 10, signal_delay_s: 30}\n")
    sweep_dir = tmp_path / "sweep"
    res = cli("sweep", str(recipe), "--grid", "trainer.lr=1e-6,3e-6,1e-5", "--parallel", "2", "--sweep-dir",
              str(sweep_dir), "--executor", "slurm", env={"RELAX_HPC_PYTHON": standin})
    assert res.returncode == 0, res.stderr
    aid = read_json(sweep_dir / "launch.json")["array_job_id"]
    try:
        runs = [RunDir(r["run_dir"]) for r in read_json(sweep_dir / "sweep.json")["runs"]]
        wait_until(lambda: events(runs[0], "colocate-0", "incarnation") and events(runs[1], "colocate-0",
                                                                                    "incarnation"),
                   "two combinations to run")
        res = cli("cancel", str(sweep_dir), "--timeout", "60")
        assert res.returncode == 0 and f"cancelled Slurm job(s) {aid}" in res.stdout, res.stderr
        q = slurm_cli.query_jobs([aid], use_sacct=False)
        assert not any(r.active for r in q.of(aid))
        assert events(runs[0], "colocate-0", "checkpointed")[0]["signal"] == "SIGTERM"
        assert not events(runs[2], "colocate-0", "incarnation")  # never started: %2
    finally:
        slurm_cli.scancel([aid])
