"""The role supervisor (relax_hpc.launch.supervisor) with real processes killed by real signals, by pid.

* its slots on plain processes: a SIGKILLed one is started again after its backoff, at most max_restarts times
  (then a ``restarts_exhausted`` alert), exit 0/2/3 are never restarted, a failing exit only for a role whose
  restart is ``failed``, a process whose heartbeat went silent is killed and started again; the restart record,
  alert and metrics it writes, and ``relax-hpc status`` showing them;
* the local executor on the demo (fully_async): a rollout worker and the trainer SIGKILLed mid-run are restarted,
  the trainer resumes from its newest complete checkpoint, the run completes and the store's accounting adds up;
* on the local Slurm cluster: the same kills inside the jobs' tasks end no job (no requeue, same job ids), and a
  cancelled rollout step is started again by its job.
"""

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

import pytest

from relax_hpc.fsio import atomic_write_json, read_json
from relax_hpc.launch import supervisor
from relax_hpc.launch.runctl import format_status, run_status
from relax_hpc.launch.supervisor import GroupRestarts, RestartPolicy, Slot, group_for, policy_for
from relax_hpc.roles import spec as roles
from relax_hpc.rundir import RunDir
from relax_hpc.store.audit import audit

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "recipes" / "demo.yaml"
SMALL = ["mode=fully_async", "warmup.steps=0", "rollout.prompts_per_step=4", "rollout.n_samples=4",
         "rollout.batch_prompts=4", "trainer.checkpoint_every=2", "trainer.async_checkpoint=false",
         "store.retention=keep", "store.keep_plans=100000", "launch.trainer.restart_backoff_s=0.2",
         "launch.rollout.restart_backoff_s=0.2", "weights.fast_path=off"]


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float, poll_s: float = 0.1) -> Any:
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def policy(**kw: Any) -> RestartPolicy:
    base: dict[str, Any] = {"on": "killed", "max_restarts": 2, "backoff_s": 0.1, "backoff_max_s": 1.0,
                            "hang_after_s": None}
    return RestartPolicy(**{**base, **kw})


def records(rd: RunDir, proc: str, kind: str | None = None) -> list[dict[str, Any]]:
    path = rd.event_log(proc)
    if not path.exists():
        return []
    out = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in out if kind is None or r.get("kind") == kind]


@pytest.fixture
def started() -> Any:
    """Popen objects started by a test; killed (by pid) at teardown whatever happened."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def sleeper(started: list[subprocess.Popen[bytes]], code: int | None = None) -> Callable[[], Any]:
    """A starter of a real process: ``sleep 60``, or one that exits with ``code`` at once."""
    def start() -> subprocess.Popen[bytes]:
        cmd = ["sleep", "60"] if code is None else [sys.executable, "-c", f"raise SystemExit({code})"]
        p = subprocess.Popen(cmd)
        started.append(p)
        return p
    return start


# ------------------------------------------------------------------------------------------------ slots
def test_sigkilled_process_is_restarted_with_backoff_then_given_up(tmp_path: Path, started: list[Any]) -> None:
    rd = RunDir.create(tmp_path / "run")
    slot = Slot(rd, "rollout", 3, policy(max_restarts=2, backoff_s=0.3), sleeper(started))
    slot.popen = slot.start()
    assert slot.step() == "running"
    pids = [slot.popen.pid]
    for n in (1, 2):
        os.kill(pids[-1], signal.SIGKILL)
        t_kill = time.monotonic()
        wait_until(lambda: slot.step() == "waiting", "the death to be noticed", 10)
        assert slot.why == "killed by SIGKILL"
        wait_until(lambda: slot.step() == "running" and slot.popen.pid != pids[-1], f"restart {n}", 10)
        assert time.monotonic() - t_kill >= 0.3 * 2 ** (n - 1) - 0.05  # the backoff doubles
        pids.append(slot.popen.pid)
    os.kill(pids[-1], signal.SIGKILL)
    wait_until(lambda: slot.step() == "ended", "the supervisor to give up", 10)
    assert slot.final == 1 and slot.restarts == 2
    slot.log.close()
    rec = read_json(rd.restarts_file("rollout-3"))
    assert rec["restarts"] == 2 and [h["pid"] for h in rec["history"]] == pids[1:]
    assert rec["gave_up"] == "killed by SIGKILL"
    alerts = [r["event"] for r in records(rd, "supervisor_rollout-3", "alert")]
    assert alerts == ["role_restarted", "role_restarted", "restarts_exhausted"]
    assert [r["metrics"]["supervisor/restarts"] for r in records(rd, "supervisor_rollout-3", "metrics")] == [1, 2]
    st = run_status(rd)
    assert st["restarts"]["rollout-3"]["restarts"] == 2
    assert "rollout-3" in format_status(st) and "gave up" in format_status(st)


@pytest.mark.parametrize(("on", "code", "restarted"), [("killed", 1, False), ("failed", 1, True),
                                                       ("failed", 0, False), ("failed", 2, False),
                                                       ("failed", 3, False)])
def test_which_exits_are_restarted(tmp_path: Path, started: list[Any], on: str, code: int, restarted: bool) -> None:
    rd = RunDir.create(tmp_path / "run")
    slot = Slot(rd, "rollout", 0, policy(on=on, backoff_s=0.0), sleeper(started, code))
    slot.popen = slot.start()
    slot.popen.wait(timeout=30)
    wait_until(lambda: slot.step() != "running", "the exit to be noticed", 10)
    if restarted:
        wait_until(lambda: slot.step() and slot.restarts == 1, "a restart", 10)
        assert slot.why == f"exit status {code}"
    else:
        assert slot.state == "ended" and slot.final == code and slot.restarts == 0


def test_silent_heartbeat_is_killed_and_restarted(tmp_path: Path, started: list[Any]) -> None:
    rd = RunDir.create(tmp_path / "run")
    slot = Slot(rd, "trainer", 0, policy(hang_after_s=5.0, backoff_s=0.0), sleeper(started))
    slot.popen = slot.start()
    hung = slot.popen
    beat = {"proc": "trainer-0", "pid": hung.pid, "state": "running", "time": time.time()}
    atomic_write_json(rd.heartbeat("trainer-0"), beat)
    assert slot.step() == "running"  # a fresh heartbeat
    atomic_write_json(rd.heartbeat("trainer-0"), {**beat, "pid": hung.pid + 1, "time": time.time() - 60})
    assert slot.step() == "running"  # another process's heartbeat says nothing about this one
    atomic_write_json(rd.heartbeat("trainer-0"), {**beat, "time": time.time() - 60})
    wait_until(lambda: slot.step() and slot.restarts == 1, "the hung process to be replaced", 10)
    assert hung.wait(timeout=10) == -signal.SIGKILL
    assert slot.why.startswith("silent (no heartbeat for")


def test_no_restart_once_the_run_completed(tmp_path: Path, started: list[Any]) -> None:
    rd = RunDir.create(tmp_path / "run")
    slot = Slot(rd, "rollout", 0, policy(backoff_s=0.0), sleeper(started))
    slot.popen = slot.start()
    atomic_write_json(rd.status_file, {"state": "completed"})
    os.kill(slot.popen.pid, signal.SIGKILL)
    wait_until(lambda: slot.step() == "ended", "the slot to end", 10)
    assert slot.restarts == 0


def _group_slots(rd: RunDir, started: list[Any], n: int = 2, **kw: Any) -> list[Slot]:
    slots = [Slot(rd, "trainer", r, policy(**kw), sleeper(started), group=GroupRestarts(rd, "trainer"))
             for r in range(n)]
    for s in slots:
        s.popen = s.start()
    return slots


def test_death_of_one_rank_restarts_the_whole_group(tmp_path: Path, started: list[Any]) -> None:
    """One rank SIGKILLed: its supervisor raises the group's generation, every other rank is stopped by pid (it
    would hang in a collective) and all start again after their backoff, each restart recorded and alerted."""
    rd = RunDir.create(tmp_path / "run")
    slots = _group_slots(rd, started, 3, backoff_s=0.2)
    old = [s.popen.pid for s in slots if s.popen]
    os.kill(old[1], signal.SIGKILL)

    def all_restarted() -> bool:
        for s in slots:
            s.step()
        return all(s.state == "running" and s.restarts == 1 for s in slots)
    wait_until(all_restarted, "every rank to restart", 15)
    assert all(s.popen is not None and s.popen.pid not in old for s in slots)
    for pid in old:  # the survivors were stopped, not left behind
        assert started[old.index(pid)].poll() is not None
    assert GroupRestarts(rd, "trainer").read()["by"] == "trainer-1" and all(s.generation == 1 for s in slots)
    for s in slots:
        s.log.close()
    reasons = {r: read_json(rd.restarts_file(f"trainer-{r}"))["history"][0]["reason"] for r in range(3)}
    assert reasons[1] == "killed by SIGKILL"
    assert reasons[0] == reasons[2] == "trainer-1 killed by SIGKILL: the trainer group restarts"
    for r in range(3):
        assert [a["event"] for a in records(rd, f"supervisor_trainer-{r}", "alert")] == ["role_restarted"]
    st = run_status(rd)
    assert st["group_restarts"]["trainer"]["generation"] == 1
    assert "process group trainer: every rank restarted 1 time(s)" in format_status(st)
    # a second death: a second group restart, counted once more per rank
    os.kill(slots[0].popen.pid, signal.SIGKILL)  # type: ignore[union-attr]
    wait_until(lambda: [s.step() for s in slots] and all(s.restarts == 2 and s.state == "running" for s in slots),
               "the second group restart", 15)
    assert GroupRestarts(rd, "trainer").generation() == 2


def test_failing_exit_of_a_rank_waits_for_its_group(tmp_path: Path, started: list[Any],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A survivor whose collective failed exits 1 before its peer's death is noticed: it joins the group restart
    that follows; a failing exit with no death in the group fails after the grace period."""
    monkeypatch.setattr(supervisor, "GROUP_GRACE_S", 1.0)
    rd = RunDir.create(tmp_path / "run")
    group = GroupRestarts(rd, "trainer")
    fail = Slot(rd, "trainer", 0, policy(backoff_s=0.0), sleeper(started, 1), group=group)
    fail.popen = fail.start()
    fail.popen.wait(timeout=30)
    assert fail.step() == "waiting"  # exit 1: not restarted alone, not failed yet
    assert group.request(0, "trainer-1", "killed by SIGKILL") == 1  # the peer's supervisor noticed its death
    wait_until(lambda: fail.step() and fail.restarts == 1, "the survivor to join the group restart", 10)
    alone = Slot(rd, "trainer", 2, policy(backoff_s=0.0), sleeper(started, 1), group=group)
    alone.popen = alone.start()
    alone.popen.wait(timeout=30)
    t0 = time.monotonic()
    wait_until(lambda: alone.step() == "ended", "the failing rank to fail", 10)
    assert alone.final == 1 and alone.restarts == 0 and time.monotonic() - t0 >= 0.9
    fail.log.close()
    alone.log.close()


def test_policy_comes_from_the_role_table_and_config() -> None:
    from relax_hpc.config.load import validate_dict

    data = {"data": {"task": {"name": "reverse_digits"}}}
    cfg = validate_dict({**data, "mode": "fully_async", "trainer": {"num_ranks": 2},
                         "launch": {"rollout": {"max_restarts": 7, "restart_backoff_s": 2}}})
    rollout = policy_for(cfg, roles.ROLLOUT)
    assert (rollout.on, rollout.max_restarts, rollout.delay(1), rollout.delay(3)) == ("failed", 7, 2.0, 8.0)
    assert policy_for(cfg, roles.TRAINER).max_restarts == 5  # two ranks in one process group: restarted together
    assert group_for(RunDir("/nonexistent"), cfg, roles.TRAINER) is not None
    assert group_for(RunDir("/nonexistent"), cfg, roles.ROLLOUT) is None
    one = validate_dict({**data, "mode": "fully_async"})
    assert group_for(RunDir("/nonexistent"), one, roles.TRAINER) is None  # one rank: restarts alone
    assert policy_for(one, roles.TRAINER).on == "killed" and policy_for(one, roles.TRAINER).max_restarts == 5


# ------------------------------------------------------------------------------------------------ end to end
def live_pid(rd: RunDir, proc: str) -> int | None:
    hb = read_json(rd.heartbeat(proc), default=None)
    if not isinstance(hb, dict) or hb.get("state") != "running":
        return None
    pid = int(hb["pid"])
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return pid if b"relax_hpc" in cmd and b"--supervise" not in cmd else None


def trainer_step(rd: RunDir) -> int:
    hb = read_json(rd.heartbeat("trainer-0"), default=None)
    return int(hb.get("step") or 0) if isinstance(hb, dict) else 0


def kill_role(rd: RunDir, proc: str, timeout_s: float = 120) -> int:
    """SIGKILL ``proc`` (the pid of its live heartbeat); returns the pid."""
    pid = wait_until(lambda: live_pid(rd, proc), f"{proc} to run", timeout_s)
    os.kill(pid, signal.SIGKILL)
    return pid


def steps_logged(rd: RunDir) -> list[int]:
    return [r["step"] for r in records(rd, "trainer-0", "metrics") if "rollout/reward" in r["metrics"]]


def check_survived(rd: RunDir, steps: int, killed: dict[str, int]) -> None:
    """The run completed, each killed process was restarted once, the trainer resumed from a checkpoint, and the
    store's accounting adds up with exactly the groups of every step trained once."""
    assert (read_json(rd.status_file) or {}).get("state") == "completed"
    for proc in killed:
        rec = read_json(rd.restarts_file(proc))
        assert rec["restarts"] == 1 and rec["history"][0]["reason"] == "killed by SIGKILL", rec
        assert [r["event"] for r in records(rd, f"supervisor_{proc}", "alert")] == ["role_restarted"]
    logged = steps_logged(rd)
    assert logged[-1] == steps and logged.count(1) == 1, logged  # resumed, not started over
    starts = [r for r in records(rd, "trainer-0", "event") if r.get("event") == "started"]
    assert len(starts) == 2
    a = audit(rd)
    assert a.balanced and a.lost == 0 and a.duplicated == 0, a.to_json()
    assert a.consumed_groups == steps * 4
    st = run_status(rd)
    assert {r["proc"]: r["restarts"] for r in st["roles"]}["trainer-0"] == 1


@pytest.mark.integration
@pytest.mark.slow
def test_local_run_survives_sigkilled_worker_and_trainer(tmp_path: Path) -> None:
    steps = 120  # the trainer must still run when its kill lands (after step 5 of the 1 s-lagged heartbeat) on a
    # machine faster than the 2-core VM too
    rd = RunDir(tmp_path / "run")
    args = [sys.executable, "-m", "relax_hpc", "submit", str(DEMO), "--executor", "local", "--run-dir", str(rd.root)]
    for s in [*SMALL, f"num_steps={steps}"]:
        args += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        wait_until(lambda: rd.heartbeat("rollout-0").exists() or launcher.poll() is not None, "rollout-0", 120)
        killed = {"rollout-0": kill_role(rd, "rollout-0")}
        wait_until(lambda: trainer_step(rd) >= 5, "trainer step 5", 180)
        killed["trainer-0"] = kill_role(rd, "trainer-0")
        out, _ = launcher.communicate(timeout=400)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)
    assert launcher.returncode == 0, out.decode()[-3000:]
    check_survived(rd, steps, killed)
    recs = read_json(rd.launch_record)["procs"]
    assert {p["proc"]: p["pid"] for p in recs}["trainer-0"] == read_json(rd.restarts_file("trainer-0"))[
        "history"][0]["pid"]  # status and cancel act on the live process


@pytest.mark.slurm
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("placement", ["separate", "hetjob"])
def test_slurm_tasks_restart_sigkilled_roles_without_ending_jobs(tmp_path: Path, placement: str) -> None:
    from relax_hpc.bench.slurm import use_local_cluster
    from relax_hpc.launch import slurm_cli
    from relax_hpc.launch.slurm import read_launch_record

    use_local_cluster()
    problem = slurm_cli.slurm_problem(timeout_s=10)
    if problem is not None:
        if os.environ.get("RELAX_REQUIRE_SLURM") == "1":
            pytest.fail(f"no Slurm cluster answers ({problem})")
        pytest.skip(f"no Slurm cluster answers ({problem}); start one with: tools/slurm_local.sh start")
    steps = 200  # 40 steps took ~4 s on an idle machine: the trainer finished before its kill could land
    rd = RunDir(tmp_path / "run")
    args = ["submit", str(DEMO), "--executor", "slurm", "--run-dir", str(rd.root)]
    for s in [*SMALL, f"num_steps={steps}", f"launch.placement={placement}", "launch.time_min=15",
              "launch.signal_delay_s=30", "launch.trainer.cpus_per_task=1"]:
        args += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "relax_hpc", *args], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    ids = [e["job_id"] for e in read_launch_record(rd)["jobs"]]
    try:
        killed = {"rollout-1": kill_role(rd, "rollout-1", 240)}
        wait_until(lambda: trainer_step(rd) >= 5, "trainer step 5", 240)
        killed["trainer-0"] = kill_role(rd, "trainer-0")

        def ended() -> bool:
            q = slurm_cli.query_jobs(ids, use_sacct=False)
            return not any(r.active for j in ids for r in q.of(j))
        wait_until(ended, "the jobs to end", 400, poll_s=1.0)
    finally:
        slurm_cli.scancel(ids)
    check_survived(rd, steps, killed)
    assert [e["job_id"] for e in read_launch_record(rd)["jobs"]] == ids
    restarted = [r for p in ("trainer-0", "rollout-1") for r in records(rd, p, "event")
                 if r.get("event") == "started" and r.get("slurm_restart_count")]
    assert not restarted, "no job should have been requeued: the tasks' supervisors restarted the roles"


def check_group_survived(rd: RunDir, steps: int, killed: str) -> None:
    """A 2-rank trainer run in which ``killed`` was SIGKILLed: it completed, both ranks were restarted once as one
    group (the other one stopped by its supervisor), they resumed from a checkpoint, and the store's accounting
    shows every produced sample consumed, dropped or unread, none lost or duplicated."""
    assert (read_json(rd.status_file) or {}).get("state") == "completed"
    other = "trainer-0" if killed == "trainer-1" else "trainer-1"
    assert read_json(rd.restarts_file(killed))["history"][0]["reason"] == "killed by SIGKILL"
    assert read_json(rd.restarts_file(other))["history"][0]["reason"] == (
        f"{killed} killed by SIGKILL: the trainer group restarts")
    for proc in ("trainer-0", "trainer-1"):
        assert read_json(rd.restarts_file(proc))["restarts"] == 1
        assert [r["event"] for r in records(rd, f"supervisor_{proc}", "alert")] == ["role_restarted"]
        assert [r["metrics"]["supervisor/restarts"] for r in records(rd, f"supervisor_{proc}", "metrics")] == [1]
        starts = [r for r in records(rd, proc, "event") if r.get("event") == "started"]
        assert len(starts) == 2, proc
    group = read_json(rd.group_restart_file("trainer"))
    assert group["generation"] == 1 and group["by"] == killed
    logged = steps_logged(rd)
    assert logged[-1] == steps and logged.count(1) == 1, logged  # resumed, not started over
    a = audit(rd)
    assert a.balanced and a.lost == 0 and a.duplicated == 0, a.to_json()
    assert a.consumed_groups == steps * 4
    st = run_status(rd)
    assert {r["proc"]: r["restarts"] for r in st["roles"]} == {
        "trainer-0": 1, "trainer-1": 1, "rollout-0": 0, "rollout-1": 0}
    assert st["group_restarts"]["trainer"]["generation"] == 1


@pytest.mark.integration
@pytest.mark.slow
def test_local_two_rank_trainer_restarts_as_a_group(tmp_path: Path) -> None:
    """A real 2-rank (gloo) trainer: rank 1 SIGKILLed mid-run; the run completes, exactly once."""
    steps = 100  # still running when the kill lands, also on a faster machine
    rd = RunDir(tmp_path / "run")
    args = [sys.executable, "-m", "relax_hpc", "submit", str(DEMO), "--executor", "local", "--run-dir", str(rd.root)]
    for s in [*SMALL, f"num_steps={steps}", "trainer.num_ranks=2"]:
        args += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        wait_until(lambda: trainer_step(rd) >= 5 or launcher.poll() is not None, "trainer step 5", 180)
        kill_role(rd, "trainer-1")
        out, _ = launcher.communicate(timeout=400)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=30)
    assert launcher.returncode == 0, out.decode()[-3000:]
    check_group_survived(rd, steps, "trainer-1")
    pids = {p["proc"]: p["pid"] for p in read_json(rd.launch_record)["procs"]}
    for proc in ("trainer-0", "trainer-1"):  # status and cancel act on the live processes
        assert pids[proc] == read_json(rd.restarts_file(proc))["history"][0]["pid"]


@pytest.mark.slurm
@pytest.mark.integration
@pytest.mark.slow
def test_slurm_two_rank_trainer_restarts_as_a_group(tmp_path: Path) -> None:
    """The same on the local Slurm cluster: each rank is a task of one step under its own supervisor; they meet
    through the run dir. Rank 0 is SIGKILLed; no job ends or is requeued."""
    from relax_hpc.bench.slurm import use_local_cluster
    from relax_hpc.launch import slurm_cli
    from relax_hpc.launch.slurm import read_launch_record

    use_local_cluster()
    problem = slurm_cli.slurm_problem(timeout_s=10)
    if problem is not None:
        if os.environ.get("RELAX_REQUIRE_SLURM") == "1":
            pytest.fail(f"no Slurm cluster answers ({problem})")
        pytest.skip(f"no Slurm cluster answers ({problem}); start one with: tools/slurm_local.sh start")
    steps = 100  # still running when the kill lands, also on a faster machine
    rd = RunDir(tmp_path / "run")
    args = ["submit", str(DEMO), "--executor", "slurm", "--run-dir", str(rd.root)]
    for s in [*SMALL, f"num_steps={steps}", "trainer.num_ranks=2", "launch.time_min=15", "launch.signal_delay_s=30",
              "launch.trainer.cpus_per_task=1"]:
        args += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "relax_hpc", *args], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    ids = [e["job_id"] for e in read_launch_record(rd)["jobs"]]
    try:
        wait_until(lambda: trainer_step(rd) >= 5, "trainer step 5", 240)
        kill_role(rd, "trainer-0")

        def ended() -> bool:
            q = slurm_cli.query_jobs(ids, use_sacct=False)
            return not any(r.active for j in ids for r in q.of(j))
        wait_until(ended, "the jobs to end", 400, poll_s=1.0)
    finally:
        slurm_cli.scancel(ids)
    check_group_survived(rd, steps, "trainer-0")
    assert [e["job_id"] for e in read_launch_record(rd)["jobs"]] == ids
