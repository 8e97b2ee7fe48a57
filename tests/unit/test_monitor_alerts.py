"""Alerts: a dead role, a NaN loss and a stall reach a local HTTP server and the event log, once each."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.cli import main
from relax_hpc.events import EventLog, Heartbeat
from relax_hpc.fsio import atomic_write_json, read_json
from relax_hpc.monitor.alerts import AlertWatcher, detect
from relax_hpc.monitor.live import Monitor, open_target
from relax_hpc.monitor.state import RunMonitor
from relax_hpc.rundir import RunDir


class Receiver:
    """A tiny HTTP server on 127.0.0.1 that keeps the JSON bodies POSTed to it."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", 0))
                received.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"json://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.close()


def troubled_run(root: Path, alert_urls: list[str], *, stall_minutes: float = 0.001) -> RunDir:
    """A run with a NaN loss at step 3, a rollout worker silent for ten minutes and a trainer stuck at step 3."""
    rd = RunDir.create(root, name="troubled")
    atomic_write_json(rd.config, {"name": "troubled", "num_steps": 100, "monitor": {
        "alert_urls": alert_urls, "dead_after_s": 60, "stall_minutes": stall_minutes}})
    with EventLog(rd, "trainer", 0) as log:
        for step, loss in ((1, 0.5), (2, 0.4), (3, float("nan"))):
            log.metrics({"train/loss": loss, "rollout/reward": 0.1}, step=step)
    Heartbeat(rd, "trainer", 0).beat(state="running", step=3)
    Heartbeat(rd, "rollout", 0).beat(state="running", version=2)
    Heartbeat(rd, "rollout", 1).beat(state="running", version=2)
    hb = read_json(rd.heartbeat("rollout-1"))
    atomic_write_json(rd.heartbeat("rollout-1"), {**hb, "time": hb["time"] - 600})
    time.sleep(0.1)  # past the 0.06 s stall limit
    return rd


def alert_records(rd: RunDir) -> list[dict[str, Any]]:
    out = []
    for path in rd.events.glob("*.jsonl"):
        out += [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "alert"]
    return out


def test_alerts_reach_http_and_event_log_once_each(tmp_path: Path, receiver: Receiver) -> None:
    rd = troubled_run(tmp_path / "run", [receiver.url])
    monitor = Monitor(open_target(rd.root))
    monitor.refresh()
    expected = {("nan_loss", "trainer-0"), ("role_dead", "rollout-1"), ("stall", "trainer-0")}
    titles = [b["title"] for b in receiver.bodies]
    assert len(titles) == 3 and all(t.startswith("relax-hpc troubled: ") for t in titles)
    assert {tuple(t.split(": ", 1)[1].split()) for t in titles} == expected
    assert all(b["type"] == "failure" and str(rd.root) in b["message"] for b in receiver.bodies)
    records = alert_records(rd)
    assert {(r["event"], r["target"]) for r in records} == expected
    assert all(r["level"] == "error" and r["role"] == "monitor" for r in records)
    assert next(r for r in records if r["event"] == "nan_loss")["step"] == 3

    for _ in range(3):  # later refreshes fire nothing new
        monitor.refresh()
    monitor.close()
    assert len(receiver.bodies) == 3 and len(alert_records(rd)) == 3

    again = Monitor(open_target(rd.root))  # a second monitor sees the alerts in the event logs
    snap = again.refresh()
    again.close()
    assert len(receiver.bodies) == 3 and len(alert_records(rd)) == 3
    assert {(a["event"], a["target"]) for a in snap["alerts"]} == expected
    assert {r["event"] for r in snap["recent"]} == {"nan_loss", "role_dead", "stall"}


def test_live_cli_fires_and_once_does_not(tmp_path: Path, receiver: Receiver) -> None:
    rd = troubled_run(tmp_path / "run", [receiver.url])
    assert main(["monitor", str(rd.root), "--once"]) == 0
    assert main(["monitor", str(rd.root), "--json"]) == 0
    assert receiver.bodies == [] and alert_records(rd) == []
    assert main(["monitor", str(rd.root), "--interval", "0.1", "--duration", "0.3"]) == 0
    assert len(receiver.bodies) == 3 and len(alert_records(rd)) == 3


def test_without_urls_alerts_still_go_to_the_event_log(tmp_path: Path) -> None:
    rd = troubled_run(tmp_path / "run", [])
    watcher = AlertWatcher(rd)
    fired = watcher.check(RunMonitor(rd).refresh())
    assert {a.event for a in fired} == {"nan_loss", "role_dead", "stall"} and watcher.sent == 0
    assert len(alert_records(rd)) == 3


def test_alerts_into_a_given_event_log(tmp_path: Path, receiver: Receiver) -> None:
    """The launcher's wait loop passes its own EventLog (and may pass the monitor settings)."""
    from relax_hpc.config.schema import MonitorConfig

    rd = troubled_run(tmp_path / "run", [])
    with EventLog(rd, "launcher", 0) as log:
        watcher = AlertWatcher(rd, MonitorConfig(alert_urls=[receiver.url]), event_log=log)
        assert len(watcher.check(RunMonitor(rd).refresh())) == 3
    assert {r["proc"] for r in alert_records(rd)} == {"launcher-0"} and len(receiver.bodies) == 3


def test_nothing_fires_for_an_ended_run_or_a_healthy_one(tmp_path: Path) -> None:
    rd = troubled_run(tmp_path / "run", [])
    atomic_write_json(rd.status_file, {"state": "failed"})
    snap = RunMonitor(rd).refresh()
    assert snap["roles"]["rollout-1"]["state"] == "dead"  # still shown
    assert detect(snap) == [] and AlertWatcher(rd).check(snap) == [] and alert_records(rd) == []

    ok = RunDir.create(tmp_path / "ok")
    atomic_write_json(ok.config, {"num_steps": 10, "monitor": {"stall_minutes": 1}})
    with EventLog(ok, "trainer", 0) as log:
        log.metrics({"train/loss": 0.3}, step=1)
    Heartbeat(ok, "trainer", 0).beat(state="running", step=1)
    Heartbeat(ok, "rollout", 0).beat(state="stopped")
    snap = RunMonitor(ok).refresh()
    assert detect(snap) == []
    assert [a.event for a in detect(snap, now=time.time() + 120)] == ["stall"]  # no progress for two minutes
    Heartbeat(ok, "trainer", 0).beat(state="stopped", step=1)
    assert detect(RunMonitor(ok).refresh(), now=time.time() + 120) == []  # a stopped trainer is not stalled


def test_bad_alert_url_does_not_break_the_monitor(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rd = troubled_run(tmp_path / "run", ["nosuchscheme://x", "json://127.0.0.1:1/"])  # port 1: refused
    watcher = AlertWatcher(rd)
    assert len(watcher.check(RunMonitor(rd).refresh())) == 3
    assert watcher.sent == 0 and len(alert_records(rd)) == 3
    assert "notification failed" in caplog.text


def test_stall_of_a_trainer_that_only_heartbeats(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    atomic_write_json(rd.config, {"num_steps": 10, "monitor": {"stall_minutes": 1}})
    hb = Heartbeat(rd, "trainer", 0, min_interval_s=0)
    hb.beat(state="running", step=2)
    mon = RunMonitor(rd)
    assert detect(mon.refresh(), now=time.time() + 30) == []
    hb.beat(step=2)  # alive, same step
    snap = mon.refresh()
    assert [(a.event, a.target) for a in detect(snap, now=time.time() + 90)] == [("stall", "trainer-0")]
    hb.beat(step=3)
    assert detect(mon.refresh(), now=time.time() + 30) == []


def test_a_resumed_trainer_is_not_stalled_by_the_age_of_the_step_it_resumed_from(tmp_path: Path) -> None:
    """A resume restarts the trainer at the checkpoint's step: the last step record (of the run before) may be hours
    old, and the new process has shown no step yet. Its start counts as progress; the stall limit runs from there."""
    rd = RunDir.create(tmp_path / "run")
    atomic_write_json(rd.config, {"num_steps": 40, "monitor": {"stall_minutes": 15}})
    with EventLog(rd, "trainer", 0) as log:
        log.metrics({"train/loss": 0.3}, step=14)
    lines = rd.events.joinpath("trainer-0.jsonl").read_text().splitlines()
    old = [json.loads(line) for line in lines]
    for r in old:  # the run before stopped 80 minutes ago
        r["time"] -= 80 * 60
    rd.events.joinpath("trainer-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    Heartbeat(rd, "trainer", 0).beat(state="running", step=14)  # the resumed trainer, just started
    snap = RunMonitor(rd).refresh()
    assert snap["step"] == 14 and time.time() - snap["last_progress_time"] < 60
    assert detect(snap) == []
    assert [a.event for a in detect(snap, now=time.time() + 16 * 60)] == ["stall"]  # stuck since its start: a stall
