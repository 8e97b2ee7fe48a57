"""Incremental tailing: half-written lines, files appearing later, truncation, a live writer process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from relax_hpc.events import EventLog
from relax_hpc.monitor.tail import METRICS_MARK, DirTail, JsonlTail
from relax_hpc.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def test_half_written_line_is_kept_for_the_next_read(tmp_path: Path) -> None:
    p = tmp_path / "a.jsonl"
    tail = JsonlTail(p)
    assert tail.read() == []  # the file does not exist yet
    append(p, b'{"n": 1}\n{"n": 2, "msg": "caf\xc3')  # cut inside a line *and* inside a UTF-8 character
    assert tail.read() == [{"n": 1}]
    assert tail.pending_bytes > 0
    assert tail.read() == []  # nothing new: the partial line is not parsed half
    append(p, b'\xa9"}\n')
    assert tail.read() == [{"n": 2, "msg": "café"}]
    assert tail.pending_bytes == 0 and tail.bad_lines == 0
    append(p, b'{"n": 3}')  # a line without newline at all
    assert tail.read() == []
    append(p, b"\n")
    assert tail.read() == [{"n": 3}]


def test_bad_lines_are_counted_and_skipped(tmp_path: Path) -> None:
    p = tmp_path / "a.jsonl"
    append(p, b'{"n": 1}\nnot json\n[1, 2]\n\n{"n": 2}\n')
    tail = JsonlTail(p)
    assert tail.read() == [{"n": 1}, {"n": 2}]
    assert tail.bad_lines == 2 and tail.lines == 2


def test_truncated_or_replaced_file_is_read_again(tmp_path: Path) -> None:
    p = tmp_path / "a.jsonl"
    append(p, b'{"n": 1}\n{"n": 2}\n')
    tail = JsonlTail(p)
    assert len(tail.read()) == 2
    tmp = tmp_path / "new"
    tmp.write_bytes(b'{"n": 10}\n')
    os.replace(tmp, p)  # a new inode
    assert tail.read() == [{"n": 10}]
    p.write_bytes(b"")  # truncated in place (shorter than what was read)
    append(p, b'{"n":1}\n')
    assert tail.read() == [{"n": 1}]


def test_dir_tail_picks_up_files_that_appear_later(tmp_path: Path) -> None:
    folder = tmp_path / "events"
    dt = DirTail(folder)
    assert dt.read() == []  # the folder itself does not exist yet
    folder.mkdir()
    append(folder / "trainer-0.jsonl", b'{"n": 1}\n')
    assert dt.read() == [("trainer-0", {"n": 1})]
    append(folder / "rollout-0.jsonl", b'{"n": 2}\n')
    append(folder / ".hidden.jsonl", b'{"n": 9}\n')
    append(folder / "notes.txt", b'{"n": 9}\n')
    append(folder / "trainer-0.jsonl", b'{"n": 3}\n')
    assert sorted(dt.read(), key=lambda x: x[1]["n"]) == [("rollout-0", {"n": 2}), ("trainer-0", {"n": 3})]
    assert dt.read() == []


def test_skip_counts_metrics_lines_of_chosen_files_without_parsing(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    with EventLog(rd, "rollout", 0) as log:
        log.metrics({"rollout/x": 1.0}, step=1)
        log.event("engine_error", "boom", level="error")
    with EventLog(rd, "trainer", 0) as log:
        log.metrics({"train/loss": 0.5}, step=1)
    dt = DirTail(rd.events, skip=lambda proc: None if proc == "trainer-0" else METRICS_MARK)
    got = {(stem, rec["kind"]) for stem, rec in dt.read()}
    assert got == {("rollout-0", "event"), ("trainer-0", "metrics")}
    assert dt.lines == 3 and dt.tails["rollout-0"].skipped == 1


def test_killed_writer_fragment_then_restart(tmp_path: Path) -> None:
    """A predecessor killed mid-line leaves a fragment; the restarted EventLog ends it, the tail skips it."""
    rd = RunDir.create(tmp_path / "run")
    path = rd.event_log("trainer-0")
    with EventLog(rd, "trainer", 0) as log:
        log.event("started")
    append(path, b'{"time": 1, "kind": "metr')  # the kill
    tail = JsonlTail(path)
    assert [r["event"] for r in tail.read()] == ["started"]
    with EventLog(rd, "trainer", 0) as log:
        log.event("restarted")
    assert [r["event"] for r in tail.read()] == ["restarted"]
    assert tail.bad_lines == 1


WRITER = """
import sys, time
from relax_hpc.rundir import RunDir
from relax_hpc.events import EventLog
rd = RunDir.open(sys.argv[1])
with EventLog(rd, "trainer", 0) as log:
    for i in range(int(sys.argv[2])):
        log.metrics({"train/loss": 1.0 / (i + 1), "pad" + "x" * (i % 300): 1.0}, step=i)
        if i % 50 == 0:
            time.sleep(0.01)
"""


def test_tail_follows_a_live_writer_process(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    n = 1500
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(rd.root), str(n)], env=env)
    tail = JsonlTail(rd.event_log("trainer-0"))
    steps: list[int] = []
    reads = 0
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            done = proc.poll() is not None
            got = tail.read()
            reads += bool(got)
            steps.extend(r["step"] for r in got)
            if done and not got:
                break
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == 0
    assert steps == list(range(n))  # every record once, in order, none torn
    assert reads > 1 and tail.bad_lines == 0
    assert json.loads(rd.event_log("trainer-0").read_text().splitlines()[-1])["step"] == n - 1
