"""The run-dir layout, the atomic primitives, event logs and heartbeats."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from relax_hpc.errors import RunDirError, WaitTimeout
from relax_hpc.events import EventLog, Heartbeat, read_heartbeats
from relax_hpc.fsio import atomic_write_json, atomic_write_text, staged_dir, wait_for
from relax_hpc.rundir import RunDir


def test_create_open_and_refusals(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run", name="x")
    assert rd.is_run_dir() and rd.info()["name"] == "x"
    assert rd.shards.is_dir() and rd.events.is_dir() and rd.weight_leases.is_dir()
    with pytest.raises(RunDirError, match="already holds a run"):
        RunDir.create(tmp_path / "run")
    assert RunDir.create(tmp_path / "run", resume=True).info()["run_id"] == rd.info()["run_id"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "thesis.tex").write_text("precious")
    with pytest.raises(RunDirError, match="not empty"):
        RunDir.create(other)
    assert (other / "thesis.tex").read_text() == "precious"
    with pytest.raises(RunDirError, match="not a relax-hpc run dir"):
        RunDir.open(other)
    with pytest.raises(RunDirError, match="does not exist"):
        RunDir.open(tmp_path / "missing")


def test_atomic_write_failure_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "state.json"
    atomic_write_json(target, {"v": 1})

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(RunDirError, match="no space left") as exc:
        atomic_write_json(target, {"v": 2})
    assert str(target) in str(exc.value)
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary debris


def test_staged_dir_is_all_or_nothing(tmp_path: Path) -> None:
    with staged_dir(tmp_path / "v1") as d:
        atomic_write_text(d / "a.txt", "a")
    assert (tmp_path / "v1" / "COMPLETE").is_file() and (tmp_path / "v1" / "a.txt").read_text() == "a"
    with pytest.raises(ValueError), staged_dir(tmp_path / "v2") as d:
        atomic_write_text(d / "a.txt", "a")
        raise ValueError("writer died")
    assert not (tmp_path / "v2").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_staged_dir_fsyncs_every_file_but_those_declared_durable(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Files the caller already made durable (declared inside the block) are not fsynced again; all others are."""
    import relax_hpc.fsio as fsio

    synced: list[str] = []
    real = fsio.fsync_file
    monkeypatch.setattr(fsio, "fsync_file", lambda p: (synced.append(p.name), real(p)))
    durable: set[str] = set()
    with staged_dir(tmp_path / "v1", durable=durable) as d:
        (d / "sub").mkdir()
        for name in ("data.bin", "meta.json", "sub/x.bin"):
            (d / name).write_text(name)
        durable.update({"data.bin", "sub/x.bin"})  # e.g. fsynced on a writer thread, or hard-linked
    assert sorted(synced) == ["meta.json"]
    assert sorted(p.relative_to(tmp_path / "v1").as_posix() for p in (tmp_path / "v1").rglob("*")) == [
        "COMPLETE", "data.bin", "meta.json", "sub", "sub/x.bin"]


def test_wait_for_times_out_naming_what() -> None:
    with pytest.raises(WaitTimeout, match="the unicorn"):
        wait_for(lambda: None, what="the unicorn", timeout_s=0.2)
    assert wait_for(lambda: 42, what="x", timeout_s=1) == 42


def test_event_log_records_and_a_half_written_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rd = RunDir.create(tmp_path / "run")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    log = EventLog(rd, "trainer", 0)
    log.event("started", "hello", step=0)
    log.metrics({"train/loss": float("nan"), "rollout/reward": 0.5}, step=1)
    log.close()
    with open(rd.event_log("trainer-0"), "ab") as f:  # a killed predecessor's partial line
        f.write(b'{"time": 1, "kind": "metr')
    log2 = EventLog(rd, "trainer", 0)
    log2.alert("nan_loss", "loss is NaN", step=1)
    log2.close()
    lines = rd.event_log("trainer-0").read_text().splitlines()
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except ValueError:
            assert line.startswith('{"time": 1, "kind": "metr')  # the partial line stays alone on its line
    assert [r["kind"] for r in parsed] == ["event", "metrics", "alert"]
    for r in parsed:
        for key in ("time", "role", "rank", "proc", "host", "pid", "step"):
            assert key in r
        assert r["slurm_job_id"] == "4242"
    assert parsed[1]["metrics"] == {"train/loss": "nan", "rollout/reward": 0.5}


def test_heartbeat_rate_limit_state_and_age(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    hb = Heartbeat(rd, "rollout", 3, min_interval_s=60)
    hb.beat(force=True, step=1)
    hb.beat(step=2)  # rate-limited: not written
    assert json.loads(rd.heartbeat("rollout-3").read_text())["step"] == 1
    hb.beat(state="paused", version=7)  # a state change is always written
    rec = read_heartbeats(rd)["rollout-3"]
    assert rec["state"] == "paused" and rec["version"] == 7 and rec["step"] == 2 and rec["age_s"] < 5
    hb.stop()
    assert read_heartbeats(rd)["rollout-3"]["state"] == "stopped"
