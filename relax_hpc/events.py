"""Event logs and heartbeats: how every process tells the run dir (and the monitor) what it is doing.

Each process appends JSON lines to its own file ``logs/events/<proc>.jsonl`` (single writer, no locks; each line is
written with one ``write`` call and flushed) and rewrites ``heartbeats/<proc>.json`` atomically.

Every record carries: ``time`` (unix seconds), ``kind`` (``event`` | ``metrics`` | ``alert``), ``role``, ``rank``,
``proc``, ``host``, ``pid``, ``step`` (may be null), Slurm ids when present (``slurm_job_id`` ...), and

* ``kind == "event"``: ``event`` (a short name such as ``started``, ``snapshot_published``, ``stopped``),
  ``level`` (``info`` | ``warning`` | ``error``), ``message`` and any extra fields;
* ``kind == "metrics"``: ``metrics``, a flat dict of metric name -> number (Relax's names, e.g. ``rollout/reward``,
  ``perf/step_time``);
* ``kind == "alert"``: like an event, raised by the alerting code (dead role, NaN loss, stall).

A heartbeat is ``{"time", "proc", "role", "rank", "host", "pid", "state", "step", "version", ...slurm ids, **extra}``
where ``state`` is one of ``starting``, ``running``, ``paused``, ``draining``, ``stopped``, ``failed``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Literal

from relax_hpc.fsio import atomic_write_json, read_json
from relax_hpc.rundir import RunDir, proc_name, slurm_ids

Level = Literal["info", "warning", "error"]
State = Literal["starting", "running", "paused", "draining", "stopped", "failed"]


def _clean(value: Any) -> Any:
    """JSON has no NaN/Inf: encode them as strings so a NaN loss is still visible to the monitor."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class EventLog:
    """Append-only JSON-lines writer for one process. Thread-safe within the process."""

    def __init__(self, run_dir: RunDir, role: str, rank: int = 0):
        self.run_dir = run_dir
        self.role = role
        self.rank = rank
        self.proc = proc_name(role, rank)
        self.path = run_dir.event_log(self.proc)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._base = {"role": role, "rank": rank, "proc": self.proc, "host": socket.gethostname(),
                      "pid": os.getpid(), **slurm_ids()}
        self._lock = threading.Lock()
        # O_APPEND: each line lands whole at the end even if a previous incarnation left a partial line.
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._needs_newline = self._ends_without_newline()

    def _ends_without_newline(self) -> bool:
        try:
            size = os.fstat(self._fd).st_size
            if size == 0:
                return False
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                return f.read(1) != b"\n"
        except OSError:
            return False

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, default=str, allow_nan=False) + "\n"
        data = line.encode()
        with self._lock:
            if self._needs_newline:  # a killed predecessor left half a line: end it so ours parses
                data = b"\n" + data
                self._needs_newline = False
            os.write(self._fd, data)

    def event(self, event: str, message: str = "", *, level: Level = "info", step: int | None = None,
              **fields: Any) -> None:
        """Record a named event (``started``, ``snapshot_published``, ``shard_quarantined`` ...)."""
        rec = {"time": time.time(), "kind": "event", **self._base, "step": step, "event": event, "level": level,
               "message": message, **{k: _clean(v) for k, v in fields.items()}}
        self._write(rec)

    def alert(self, event: str, message: str, *, step: int | None = None, **fields: Any) -> None:
        """Record an alert (dead role, NaN loss, stall). Notification sinks read these too."""
        rec = {"time": time.time(), "kind": "alert", **self._base, "step": step, "event": event, "level": "error",
               "message": message, **{k: _clean(v) for k, v in fields.items()}}
        self._write(rec)

    def metrics(self, metrics: dict[str, float | int], *, step: int | None = None) -> None:
        """Record one step's metrics (flat name -> number)."""
        rec = {"time": time.time(), "kind": "metrics", **self._base, "step": step,
               "metrics": {k: _clean(float(v) if not isinstance(v, int) else v) for k, v in metrics.items()}}
        self._write(rec)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Heartbeat:
    """Atomically rewritten liveness file of one process. Call :meth:`beat` often (cheap), or :meth:`start_thread`."""

    def __init__(self, run_dir: RunDir, role: str, rank: int = 0, *, min_interval_s: float = 1.0):
        self.proc = proc_name(role, rank)
        self.path = run_dir.heartbeat(self.proc)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.min_interval_s = min_interval_s
        self._state: dict[str, Any] = {"proc": self.proc, "role": role, "rank": rank, "host": socket.gethostname(),
                                       "pid": os.getpid(), "state": "starting", "step": None, "version": None,
                                       "started": time.time(), **slurm_ids()}
        self._last = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, *, force: bool = False, state: State | None = None, **fields: Any) -> None:
        """Update fields (``step``, ``version``, ``state`` ...) and rewrite the file at most every min_interval_s."""
        with self._lock:
            if state is not None:
                self._state["state"] = state
            self._state.update(fields)
            now = time.time()
            if not force and state is None and now - self._last < self.min_interval_s:
                return
            self._last = now
            self._state["time"] = now
            snapshot = dict(self._state)
        atomic_write_json(self.path, snapshot, fsync=False, indent=None)

    def start_thread(self, interval_s: float = 5.0) -> None:
        """Beat from a daemon thread every ``interval_s`` so long steps do not look like a dead process."""
        def loop() -> None:
            while not self._stop.wait(interval_s):
                with contextlib.suppress(Exception):  # a full disk must not kill the process from a side thread
                    self.beat(force=True)
        self._thread = threading.Thread(target=loop, name=f"heartbeat-{self.proc}", daemon=True)
        self._thread.start()

    def stop(self, state: State = "stopped") -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.beat(state=state, force=True)


def read_heartbeats(run_dir: RunDir) -> dict[str, dict[str, Any]]:
    """All heartbeats of a run: proc -> record (with ``age_s`` added). Unreadable files are skipped."""
    out: dict[str, dict[str, Any]] = {}
    folder = run_dir.heartbeats
    if not folder.is_dir():
        return out
    now = time.time()
    for p in folder.glob("*.json"):
        if p.name.startswith("."):
            continue
        try:
            rec = read_json(p, expect=dict)
        except (OSError, ValueError):
            continue
        rec["age_s"] = max(0.0, now - float(rec.get("time", now)))
        out[p.stem] = rec
    return out


def heartbeat_path(run_dir: RunDir, role: str, rank: int) -> Path:
    return run_dir.heartbeat(proc_name(role, rank))
