"""One inference server process: start on a free port, wait until healthy, stop, restart with backoff.

The server runs in its own process group (so SIGTERM/SIGKILL reach its children: vLLM's engine core, SGLang's
scheduler) and gets SIGTERM when the process that started it dies (``PR_SET_PDEATHSIG`` on Linux), so a rollout
worker killed by Slurm or preemption never leaves a server behind. Its stdout/stderr go to a log file in the run
dir; its host, port, pid and command are recorded there too (:meth:`relax_hpc.rundir.RunDir.server_record`).

Linux delivers the parent-death signal when the *thread* that started the server exits, so start servers from a
thread that lives as long as the engine (the event loop's thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_hpc.errors import UserError
from relax_hpc.fsio import atomic_write_json

LOG_TAIL_LINES = 40


class ServerStartError(UserError):
    """A server that could not start: missing command, exit at start, port in use, never healthy, bad model.
    The first line says what happened and names the server log; the log's last lines follow."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log (empty when there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


START_FAILURES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("Free memory on device", "GPU memory utilization"),
     "not enough free GPU memory for the server's share (rollout.server.gpu_memory_utilization; in colocate the "
     "trainer holds the rest): lower the share, or free the GPU"),
    (("Available memory on node", "less than"),
     "not enough free host memory for the CPU server (vLLM's --gpu-memory-utilization / VLLM_CPU_KVCACHE_SPACE)"),
    (("Not enough memory. Please try to increase --mem-fraction-static",),
     "the server's share of GPU memory leaves no room for its KV cache (rollout.server.gpu_memory_utilization)"),
    (("CUDA out of memory",), "out of GPU memory at start (rollout.server.gpu_memory_utilization)"),
    (("undefined symbol",),
     "its compiled extensions do not match the installed torch (an 'undefined symbol' at import: install the "
     "server build made for this torch)"),
)
"""Known causes of a server that exits at start: (substrings all found in one line of its log, what it means). The
texts are the servers' own: vLLM 0.32 ``v1/worker/utils.py`` (GPU) and ``v1/worker/cpu_worker.py`` (CPU), SGLang
0.5.10 ``model_executor/model_runner_kv_cache_mixin.py``; a dynamic loader's ``undefined symbol`` is what a build
compiled against another torch raises."""


def start_failure_cause(tail: str) -> str | None:
    """The known cause (:data:`START_FAILURES`) a server log's last lines show, None when none."""
    for line in reversed(tail.splitlines()):
        for needles, cause in START_FAILURES:
            if all(n in line for n in needles):
                return cause
    return None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


@dataclass
class ServerSpec:
    """What to start and how to tell it is ready."""

    name: str
    """``rollout-0-0``: names the record and the log."""
    argv: list[str]
    """The full command line (the configured command + the engine's arguments + extra arguments)."""
    host: str
    port: int
    health_path: str
    log: Path
    record: Path
    env: dict[str, str] = field(default_factory=dict)
    """Added to the environment of this process."""
    startup_timeout_s: float = 600.0
    stop_grace_s: float = 10.0


class ServerProcess:
    """A running (or stopped) server; ``start`` + ``wait_ready`` bring it up, ``stop`` takes it down."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def _fail(self, what: str) -> ServerStartError:
        tail = log_tail(self.spec.log)
        body = f"\n--- last {LOG_TAIL_LINES} lines of {self.spec.log} ---\n{tail}" if tail else ""
        return ServerStartError(f"inference server {self.spec.name}: {what} (server log: {self.spec.log}){body}")

    def refuse(self, problem: str) -> ServerStartError:
        """The error for a server not started because of ``problem`` (written to its log too)."""
        self.spec.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.spec.log, "a") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} not started: {problem}\n")
        return self._fail(f"not started: {problem}")

    def start(self) -> None:
        s = self.spec
        if port_in_use(s.port, s.host):
            raise self._fail(f"port {s.port} on {s.host} is already in use")
        s.log.parent.mkdir(parents=True, exist_ok=True)
        with open(s.log, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {shlex.join(s.argv)}\n".encode())
            log.flush()
            try:
                self.proc = subprocess.Popen(s.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env={**os.environ, **s.env}, start_new_session=True,
                                             preexec_fn=_die_with_parent)
            except (FileNotFoundError, PermissionError) as exc:
                log.write(f"cannot run {s.argv[0]!r}: {exc}\n".encode())
                log.flush()
                raise self._fail(f"the server command {s.argv[0]!r} cannot be run ({exc.strerror})") from None
        self.started_at = time.monotonic()
        self._write_record("starting")

    def _write_record(self, state: str) -> None:
        s = self.spec
        s.record.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(s.record, {
            "name": s.name, "host": socket.gethostname(), "bind_host": s.host, "port": s.port,
            "pid": self.proc.pid if self.proc else None, "url": self.url, "command": s.argv, "log": str(s.log),
            "state": state, "time": time.time(),
        })

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def wait_ready(self, client: Any) -> float:
        """Poll the health endpoint until it answers 200 (seconds it took). The server exiting or the startup
        timeout running out raises :class:`ServerStartError` (and the server is stopped)."""
        s = self.spec
        deadline = self.started_at + s.startup_timeout_s
        while True:
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                cause = start_failure_cause(log_tail(s.log, 200))
                raise self._fail(f"the server exited at start (exit code {code})" + (f": {cause}" if cause else ""))
            try:
                r = await client.get(self.url + s.health_path, timeout=5.0)
                if r.status_code == 200:
                    self._write_record("ready")
                    return time.monotonic() - self.started_at
            except Exception:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise self._fail(f"not healthy after {s.startup_timeout_s:.0f} s (GET {s.health_path})")
            await asyncio.sleep(0.5)

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM to the server's process group, SIGKILL after the grace period; returns the exit code."""
        if self.proc is None:
            return None
        grace = self.spec.stop_grace_s if grace_s is None else grace_s
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(timeout=10.0)
        # children left in the group (the engine core) go too
        self._signal(signal.SIGKILL)
        with contextlib.suppress(OSError):
            self._write_record("stopped")
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def build_argv(command: str | Sequence[str], args: Sequence[str], extra: Sequence[str]) -> list[str]:
    """The configured command (a string is split like a shell would: ``apptainer exec img.sif python -m ...``),
    then the engine's own arguments, then the user's extra arguments."""
    head = shlex.split(command) if isinstance(command, str) else list(command)
    if not head:
        raise UserError("rollout.server.command is empty")
    return [*head, *args, *extra]
