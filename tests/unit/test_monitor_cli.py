"""``relax-hpc monitor``: --once / --json on run dirs written by real role processes, dead roles, Slurm, sweeps."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from relax_hpc.cli import main
from relax_hpc.events import EventLog, Heartbeat
from relax_hpc.fsio import atomic_write_json, read_json
from relax_hpc.monitor.slurm import SlurmPoller, parse_squeue
from relax_hpc.monitor.state import RunMonitor
from relax_hpc.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]

from tests.helpers.monitorrun import make_run, role_process, trainer_metrics  # noqa: E402


@pytest.fixture(scope="module")
def run3(tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """A run written by three real processes: a trainer at step 5, a warning rollout worker, a stopped one."""
    rd = make_run(tmp_path_factory.mktemp("m") / "run")
    role_process(rd, role="trainer", rank=0, step=5, version=5,
                 metrics=[[s, trainer_metrics(s)] for s in range(1, 6)])
    role_process(rd, role="rollout", rank=0, version=4,
                 events=[{"event": "slow_generate", "message": "batch took 40 s", "level": "warning"}])
    role_process(rd, role="rollout", rank=1, version=3, state="stopped")
    return rd


def test_json_snapshot(run3: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["monitor", str(run3.root), "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["step"] == 5 and snap["total_steps"] == 10 and snap["progress"] == 0.5
    assert snap["reward_mean"] == pytest.approx(0.5)
    assert snap["loss"] == 0.5 and snap["kl"] == 0.01 and snap["tokens_per_s"] == 3000.0
    assert snap["weight_version"] == 5 and snap["backlog"] == 64
    assert snap["reward_trend"] == pytest.approx(0.1)
    assert snap["state"] == "running" and snap["mode"] == "fully_async"
    roles = snap["roles"]
    assert set(roles) == {"trainer-0", "rollout-0", "rollout-1"}
    assert roles["trainer-0"]["state"] == "running" and roles["rollout-1"]["state"] == "stopped"
    assert roles["rollout-0"]["version"] == 4
    assert all(0 <= r["heartbeat_age_s"] < 60 for r in roles.values())
    pids = {r["pid"] for r in roles.values()}
    assert len(pids) == 3 and os.getpid() not in pids  # written by three other processes
    assert [r["message"] for r in snap["recent"]] == ["batch took 40 s"]
    assert snap["alerts"] == []


def test_once_text(run3: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["monitor", str(run3.root), "--once"]) == 0
    out = capsys.readouterr().out
    for text in ("step 5/10", "trainer-0", "rollout-0", "rollout-1", "stopped", "batch took 40 s", "v4", "3,000"):
        assert text in out, text
    assert not list(run3.events.glob("monitor-*")), "--once must not write to the run dir"


def test_dead_role_from_an_old_heartbeat(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rd = make_run(tmp_path / "run", monitor={"dead_after_s": 30})
    role_process(rd, role="trainer", rank=0, step=1, metrics=[[1, trainer_metrics(1)]])
    for rank, state in ((0, "running"), (1, "stopped"), (2, "paused")):
        role_process(rd, role="rollout", rank=rank, state=state)
        hb = read_json(rd.heartbeat(f"rollout-{rank}"))
        atomic_write_json(rd.heartbeat(f"rollout-{rank}"), {**hb, "time": hb["time"] - 600})  # ten minutes ago
    assert main(["monitor", str(rd.root), "--json"]) == 0
    roles = json.loads(capsys.readouterr().out)["roles"]
    assert roles["rollout-0"]["state"] == "dead" and roles["rollout-0"]["heartbeat_age_s"] >= 600
    assert roles["rollout-1"]["state"] == "stopped"  # a clean stop is never dead
    assert roles["rollout-2"]["state"] == "dead" and roles["rollout-2"]["heartbeat_state"] == "paused"
    assert roles["trainer-0"]["state"] == "running"
    assert main(["monitor", str(rd.root), "--once"]) == 0
    out = capsys.readouterr().out
    assert out.index("rollout-0") < out.index("trainer-0")  # problems are listed first


def test_nan_loss_and_missing_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rd = make_run(tmp_path / "run")
    with EventLog(rd, "colocate", 0) as log:
        log.metrics({"train/loss": float("nan")}, step=3)
    Heartbeat(rd, "colocate", 0).beat(state="running", step=3)
    assert main(["monitor", str(rd.root), "--json"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["trainer_proc"] == "colocate-0" and snap["loss"] == "nan" and snap["reward_mean"] is None
    assert main(["monitor", str(rd.root), "--once"]) == 0
    out = capsys.readouterr().out
    assert "nan" in out and "tokens/s" in out and " - " in out


def test_not_a_run_dir_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "file.txt").write_text("x")
    for target in (tmp_path / "stuff", tmp_path / "missing", tmp_path / "stuff" / "file.txt"):
        assert main(["monitor", str(target), "--once"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert main(["plot", str(target), "-o", str(tmp_path / "x.png")]) == 2
        assert capsys.readouterr().err.count("\n") == 1
    assert main(["monitor", str(tmp_path / "stuff"), "--interval", "0"]) == 2


def test_live_view_refreshes_and_stops(run3: RunDir, capsys: pytest.CaptureFixture[str]) -> None:
    t = time.monotonic()
    assert main(["monitor", str(run3.root), "--interval", "0.1", "--duration", "0.5", "--no-alerts"]) == 0
    assert time.monotonic() - t < 30
    assert "trainer-0" in capsys.readouterr().out


def test_refresh_reads_only_what_was_appended(tmp_path: Path) -> None:
    rd = make_run(tmp_path / "run")
    log = EventLog(rd, "trainer", 0)
    hb = Heartbeat(rd, "trainer", 0, min_interval_s=0)
    mon = RunMonitor(rd)
    assert mon.refresh()["state"] == "pending"
    log.metrics(trainer_metrics(1), step=1)
    hb.beat(state="running", step=1)
    snap = mon.refresh()
    assert (snap["step"], snap["lines_read"], snap["state"]) == (1, 1, "running")
    EventLog(rd, "rollout", 7).event("late_file", "appeared later", level="error")
    log.metrics(trainer_metrics(2, loss=0.25), step=2)
    snap = mon.refresh()
    assert (snap["step"], snap["loss"], snap["lines_read"]) == (2, 0.25, 3)
    assert snap["recent"][-1]["proc"] == "rollout-7"
    atomic_write_json(rd.status_file, {"state": "completed"})
    snap = mon.refresh()
    assert snap["state"] == "completed" and snap["ended"] and snap["eta_s"] is None


def fake_squeue(folder: Path, output: str) -> Path:
    """A real ``squeue`` executable on PATH that prints ``output`` and logs its arguments."""
    folder.mkdir(parents=True, exist_ok=True)
    exe = folder / "squeue"
    exe.write_text(f"#!/bin/sh\necho \"$@\" >> {folder / 'calls.log'}\nprintf '{output}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return folder / "calls.log"


def test_slurm_states_batched_and_rate_limited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    rd = make_run(tmp_path / "run")
    atomic_write_json(rd.launch_record, {"executor": "slurm", "jobs": [{"job_id": "111"}, "112"],
                                         "procs": ["trainer-0", "rollout-0", "rollout-1"]})
    role_process(rd, env={"SLURM_JOB_ID": "111"}, role="trainer", rank=0, step=1)
    role_process(rd, env={"SLURM_JOB_ID": "130", "SLURM_ARRAY_JOB_ID": "112", "SLURM_ARRAY_TASK_ID": "0"},
                 role="rollout", rank=0)
    calls = fake_squeue(tmp_path / "bin", "111 111 RUNNING\\n112_0 130 PENDING\\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    mon = RunMonitor(rd, slurm=SlurmPoller(min_interval_s=10))
    roles = mon.refresh()["roles"]
    assert roles["trainer-0"]["slurm_state"] == "RUNNING" and roles["trainer-0"]["slurm_job_id"] == "111"
    assert roles["rollout-0"]["slurm_state"] == "PENDING" and roles["rollout-0"]["slurm_job_id"] == "112_0"
    assert roles["rollout-1"]["state"] == "waiting"  # launched, no heartbeat yet
    mon.refresh()
    mon.refresh()
    lines = calls.read_text().splitlines()
    assert len(lines) == 1 and "-j 111,112,130" in lines[0] and "%i %A %T" in lines[0]
    assert main(["monitor", str(rd.root), "--once"]) == 0
    assert "RUNNING" in capsys.readouterr().out


def test_squeue_missing_or_failing_is_quiet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert SlurmPoller().states(["1"]) == {}
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "squeue").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id' >&2\nexit 1\n")
    (folder / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))
    assert SlurmPoller().states(["1"]) == {}
    assert parse_squeue("5 RUNNING\n6_1 9 COMPLETING\n\nbad\n") == {"5": "RUNNING", "6_1": "COMPLETING",
                                                                  "9": "COMPLETING"}


def test_sweep_table(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # the overrides stay on one line
    sweep = tmp_path / "sweep"
    for i, lr in enumerate(("1e-6", "3e-6")):
        rd = make_run(sweep / f"lr{lr}", name=f"lr{lr}", num_steps=20)
        with EventLog(rd, "trainer", 0) as log:
            for s in range(1, 4 + i):
                log.metrics(trainer_metrics(s), step=s)
        Heartbeat(rd, "trainer", 0).beat(state="running", step=3 + i)
    make_run(tmp_path / "elsewhere", name="listed")  # a run outside the folder, listed by sweep.json
    atomic_write_json(sweep / "sweep.json", {"runs": [
        {"run_dir": str(tmp_path / "elsewhere"), "label": "listed", "overrides": {"algorithm.lr": 1e-5}},
        {"run_dir": "not-started", "overrides": ["algorithm.lr=3e-5"]}]})
    assert main(["monitor", str(sweep), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["label"]: r for r in out["runs"]}
    assert set(rows) == {"lr1e-6", "lr3e-6", "listed", "not-started"}
    assert rows["lr1e-6"]["step"] == 3 and rows["lr3e-6"]["step"] == 4 and rows["lr3e-6"]["total_steps"] == 20
    assert rows["listed"]["params"] == {"algorithm.lr": 1e-5} and rows["listed"]["state"] == "pending"
    assert rows["not-started"]["state"] == "pending" and "run_id" not in rows["not-started"]
    assert main(["monitor", str(sweep), "--once"]) == 0
    text = capsys.readouterr().out
    for label in ("lr1e-6", "lr3e-6", "listed", "not-started", "3/20", "4/20", "algorithm.lr=1e-05"):
        assert label in text, label


def test_many_roles_are_summarised(tmp_path: Path) -> None:
    import io

    from rich.console import Console

    from relax_hpc.bench.monitor import SyntheticRun
    from relax_hpc.monitor.view import run_view

    run = SyntheticRun(tmp_path / "run", num_roles=64)
    run.append(200)
    run.close()
    snap = RunMonitor(run.rd).refresh()
    assert len(snap["roles"]) == 64 and snap["step"] == 100 and snap["lines_read"] == 200
    buf = io.StringIO()
    Console(file=buf, width=140).print(run_view(snap, max_role_rows=10))
    text = buf.getvalue()
    assert "trainer-0" in text and "… 54 more: 54 running" in text
