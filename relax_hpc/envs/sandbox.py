"""A sandbox for code and shell tools: every call is a fresh subprocess with limits, and it can fail only as a
result (never as an exception in the episode).

What one call gets, on Linux (measured on the dev machine: all of it works there, as root and unprivileged):

* its own temporary working directory (``HOME`` and ``TMPDIR`` point into it), removed after the call;
* an environment stripped to ``sandbox.env_allow`` (secrets of the role are not inherited);
* rlimits: CPU seconds, address space (memory), processes, file size, open files, no core dumps;
* a wall-clock timeout, after which the call's process group is killed (SIGKILL); the call also runs as PID 1 of its
  own PID namespace (``unshare --pid --fork --kill-child``), so children that escape the process group (``setsid``)
  die with it;
* no network: an unshared network namespace (``unshare --net`` inside a user namespace) with only loopback, where
  the kernel allows unprivileged user namespaces; else a warning once and the host network;
* writes outside the working directory refused: when the role runs as root, calls run as ``nobody`` (``setpriv``),
  so the file permissions refuse writes anywhere but world-writable places; the Python tool also installs an audit
  hook (:pep:`578`) that refuses opening files for writing, deleting, renaming or creating outside the working
  directory, starting other programs, and ``ctypes`` (which could undo the hook). A shell tool run as ``nobody`` can
  still write to world-writable folders (``/tmp``, ``/dev/shm``); use a container runtime where that matters.

A site's container runtime instead: set ``sandbox.wrapper`` to the command prefix, e.g.
``[apptainer, exec, --containall, --no-home, --net, --network, none, --bind, "{cwd}:/work", --pwd, /work,
tools.sif]`` or ``[enroot, start, --rw, --mount, "{cwd}:/work", tools]``; ``{cwd}`` is replaced by the call's
directory. The rlimits, the stripped environment and the timeout still apply; the namespaces above are then the
runtime's job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from relax_hpc.config.schema import SandboxConfig

log = logging.getLogger(__name__)

NOBODY = 65534


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of one call."""

    stdout: str
    stderr: str
    returncode: int | None
    """None when the call was killed at its timeout."""
    timed_out: bool
    latency_s: float
    signal_name: str | None = None
    """The signal that ended the call (``SIGKILL`` at the timeout, ``SIGXCPU`` past the CPU limit ...)."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self) -> str:
        """The text the model reads."""
        if self.timed_out:
            return f"error: killed after the {self.latency_s:.1f}s timeout\n{self.stdout}".rstrip()
        if self.signal_name:
            return f"error: killed by {self.signal_name}\n{self.stdout}{self.stderr}".rstrip()
        if self.returncode:
            tail = "\n".join(self.stderr.strip().splitlines()[-3:])
            return f"error (exit {self.returncode}):\n{self.stdout}{tail}".rstrip()
        return self.stdout if self.stdout else self.stderr


@dataclass(frozen=True)
class Isolation:
    """What this machine allows (probed once per process)."""

    namespaces: bool
    """``unshare --user --map-root-user --net --pid --fork`` works."""
    drop_to_nobody: bool
    """Running as root, ``setpriv`` to nobody works with the chosen interpreter."""
    python: str


def _rlimits(cfg: SandboxConfig, nproc: bool) -> None:  # runs in the child between fork and exec
    mib = 1 << 20
    resource.setrlimit(resource.RLIMIT_CPU, (cfg.cpu_s, cfg.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg.memory_mb * mib, cfg.memory_mb * mib))
    if nproc:  # counts every process of the user: only meaningful for the sandbox's own user (nobody)
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg.max_processes, cfg.max_processes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg.max_file_mb * mib, cfg.max_file_mb * mib))
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _runs(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=20, cwd="/").returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


_SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
_UNSHARE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child"]


@lru_cache(maxsize=8)
def probe(python: str | None, drop_privileges: bool) -> Isolation:
    """The strongest isolation this machine allows, and an interpreter that runs under it (probed once)."""
    candidates = [p for p in ([python] if python else [sys.executable, "/usr/bin/python3"]) if p and os.path.exists(p)]
    drop = os.geteuid() == 0 and drop_privileges and shutil.which("setpriv") is not None
    user = list(_SETPRIV) if drop else []
    for py in candidates:  # best: own user, namespaces
        if _runs(user + _UNSHARE + ["--net", py, "-I", "-c", "pass"]):
            return Isolation(True, drop, py)
    for py in candidates:
        if _runs([*user, py, "-I", "-c", "pass"]):
            return Isolation(False, drop, py)
    py = candidates[0] if candidates else sys.executable
    log.warning("sandbox: no interpreter runs as nobody; tool calls run as the role's own user (%s)", py)
    return Isolation(False, False, py)


def command(argv: list[str], cfg: SandboxConfig, cwd: Path, iso: Isolation) -> list[str]:
    """The full command line of one call."""
    if cfg.wrapper:
        return [a.replace("{cwd}", str(cwd)) for a in cfg.wrapper] + argv
    prefix = list(_SETPRIV) if iso.drop_to_nobody else []
    if iso.namespaces:
        prefix += _UNSHARE + (["--net"] if cfg.network == "off" else [])
    elif cfg.network == "off":
        _warn_network_once()
    return prefix + argv


@lru_cache(maxsize=1)
def _warn_network_once() -> None:
    log.warning("sandbox: this machine does not allow unprivileged network namespaces; tool calls keep the network")


def _env(cfg: SandboxConfig, cwd: Path) -> dict[str, str]:
    env = {k: os.environ[k] for k in cfg.env_allow if k in os.environ}
    env.update(HOME=str(cwd), TMPDIR=str(cwd), PYTHONDONTWRITEBYTECODE="1")
    return env


async def run(argv: list[str], cfg: SandboxConfig, *, files: dict[str, str] | None = None,
              stdin: bytes | None = None) -> SandboxResult:
    """Run ``argv`` in a fresh sandbox; ``files`` are written into its working directory first."""
    iso = probe(cfg.python, cfg.drop_privileges)
    cwd = Path(tempfile.mkdtemp(prefix="relax-sandbox-"))
    t0 = time.perf_counter()
    try:
        for name, text in (files or {}).items():
            (cwd / name).write_text(text)
        if iso.drop_to_nobody and not cfg.wrapper:
            for p in [cwd, *cwd.iterdir()]:
                os.chown(p, NOBODY, NOBODY)
        out_path, err_path = cwd / ".stdout", cwd / ".stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = await asyncio.create_subprocess_exec(
                *command(argv, cfg, cwd, iso), cwd=cwd, env=_env(cfg, cwd), stdout=out, stderr=err,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, start_new_session=True,
                preexec_fn=lambda: _rlimits(cfg, iso.drop_to_nobody and not cfg.wrapper))
            timed_out = await _wait(proc, stdin, cfg.timeout_s)
        rc = proc.returncode
        sig = signal.Signals(-rc).name if rc is not None and rc < 0 and not timed_out else None
        return SandboxResult(_read(out_path, cfg.max_output_bytes), _read(err_path, cfg.max_output_bytes),
                             None if timed_out else rc, timed_out, time.perf_counter() - t0, sig)
    finally:
        shutil.rmtree(cwd, ignore_errors=True)


async def _wait(proc: asyncio.subprocess.Process, stdin: bytes | None, timeout_s: float) -> bool:
    """Wait for the call; kill its process group at the timeout. True if it timed out."""
    try:
        await asyncio.wait_for(proc.communicate(stdin), timeout_s)
        return False
    except asyncio.TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 30)
        return True


def _read(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    return text + ("\n...[output cut]" if len(data) > limit else "")


# ------------------------------------------------------------------------------------------ the python tool
_BOOT = r'''
import os, sys
_root = os.path.realpath(os.getcwd())
_W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATHS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod", "os.chown",
          "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}
_EXEC = {"subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn", "ctypes.dlopen",
         "ctypes.dlsym", "ctypes.cdata", "os.startfile"}
def _inside(p):
    if isinstance(p, int):
        return True
    try:
        rp = os.path.realpath(os.fsdecode(p))
    except Exception:
        return False
    return rp == _root or rp.startswith(_root + os.sep) or rp == "/dev/null"
def _hook(event, args):
    if event == "open":
        path, mode, flags = (tuple(args) + (None, 0))[:3]
        write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _W)
        if write and not _inside(path):
            raise PermissionError(f"sandbox: writing outside the working directory is refused: {path}")
    elif event in _PATHS:
        for a in args[:2]:
            if isinstance(a, (str, bytes, os.PathLike)) and not _inside(a):
                raise PermissionError(f"sandbox: {event} outside the working directory is refused: {a}")
    elif event in _EXEC:
        raise PermissionError(f"sandbox: {event} is refused")
sys.addaudithook(_hook)
del _hook
_src = open("main.py").read()
exec(compile(_src, "main.py", "exec"), {"__name__": "__main__"})
'''


def python_tool(cfg: SandboxConfig) -> Callable[[str], Awaitable[Any]]:
    """The built-in Python-execution tool bound to ``cfg``: ``python(code: str)``; a failed call returns an error
    :class:`~relax_hpc.envs.tools.ToolResult` (counted as a tool error), a good one what the code printed."""

    async def python(code: str) -> Any:
        """Run Python code in a sandbox and return what it prints (stdout; stderr on failure)."""
        iso = probe(cfg.python, cfg.drop_privileges)
        res = await run([iso.python, "-I", "boot.py"], cfg, files={"boot.py": _BOOT, "main.py": code})
        return sandbox_text(res)

    return python


def sandbox_text(res: SandboxResult, name: str = "python") -> Any:
    """A call's outcome as a tool's return value: its output, or an error result."""
    from relax_hpc.envs.tools import ToolResult

    if res.ok:
        return res.describe()
    return ToolResult(name, res.describe(), "sandbox", res.latency_s)
