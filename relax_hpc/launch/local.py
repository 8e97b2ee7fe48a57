"""The local executor (the embedded default): every role is a local process, linked only by the run dir.

Processes are started in their own session (so a Ctrl-C of the launcher does not hit them by accident), with stdout
and stderr appended to ``logs/<proc>.log``; their pids are recorded in ``launch.json`` so ``relax-hpc status`` and
``relax-hpc cancel`` act on exactly these processes and no others.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.errors import UserError
from relax_hpc.fsio import atomic_write_json, read_json
from relax_hpc.rundir import RunDir, proc_name


@dataclass
class LocalProc:
    role: str
    rank: int
    popen: subprocess.Popen[bytes]

    @property
    def proc(self) -> str:
        return proc_name(self.role, self.rank)


def role_plan(cfg: RecipeConfig) -> list[tuple[str, int]]:
    """(role, rank) of every process the run needs."""
    if cfg.mode == "colocate":
        return [("colocate", r) for r in range(cfg.trainer.num_ranks)]
    return [("trainer", r) for r in range(cfg.trainer.num_ranks)] + \
        [("rollout", r) for r in range(cfg.rollout.num_workers)]


def start_role(run_dir: RunDir, cfg: RecipeConfig, role: str, rank: int, *, num_procs: int = 1) -> LocalProc:
    """Start one role process (``python -m relax_hpc role ...``). Threads per process are the role's
    ``cpus_per_task``, capped so that ``num_procs`` processes together do not oversubscribe this machine."""
    env = dict(os.environ)
    res = cfg.launch.trainer if role in ("trainer", "colocate") else cfg.launch.rollout
    env.update(res.env)
    fair = max(1, (os.cpu_count() or 1) // max(1, num_procs))
    env.setdefault("OMP_NUM_THREADS", str(max(1, min(res.cpus_per_task, fair))))
    env["PYTHONUNBUFFERED"] = "1"
    log = run_dir.text_log(proc_name(role, rank)).with_suffix(".out")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "relax_hpc", "role", role, "--run-dir", str(run_dir.root), "--rank", str(rank)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
            preexec_fn=_pin(res.cpu_affinity),
        )
    return LocalProc(role, rank, popen)


def _pin(cpus: list[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` pinning the child to ``cpus`` before it starts any thread (None: no pinning).

    CPUs this process may not use are an error here, in the launcher, rather than a failed exec in the child."""
    if not cpus:
        return None
    allowed = os.sched_getaffinity(0)
    if not set(cpus) <= allowed:
        raise UserError(f"cpu_affinity {cpus}: CPUs {sorted(set(cpus) - allowed)} are not available here "
                        f"(allowed: {sorted(allowed)})")
    mask = set(cpus)
    return lambda: os.sched_setaffinity(0, mask)


def record(run_dir: RunDir, procs: list[LocalProc], *, append: bool = False) -> None:
    """Write (or extend) launch.json with the started processes."""
    old = read_json(run_dir.launch_record, default={}) if append else {}
    entries = list(old.get("procs", [])) if append else []
    entries += [{"role": p.role, "rank": p.rank, "proc": p.proc, "pid": p.popen.pid, "host": os.uname().nodename,
                 "started": time.time()} for p in procs]
    atomic_write_json(run_dir.launch_record, {"executor": "local", "procs": entries, "jobs": []})


def launch(run_dir: RunDir, cfg: RecipeConfig) -> list[LocalProc]:
    """Start every role of the run as a local process and record them."""
    plan = role_plan(cfg)
    procs = [start_role(run_dir, cfg, role, rank, num_procs=len(plan)) for role, rank in plan]
    record(run_dir, procs)
    return procs


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def terminate(procs: list[LocalProc], *, timeout_s: float = 30.0) -> None:
    """SIGTERM our processes (they checkpoint), then SIGKILL whatever is left after ``timeout_s``."""
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    end = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.popen.kill()
            p.popen.wait(timeout=10)


def supervise(run_dir: RunDir, cfg: RecipeConfig, procs: list[LocalProc], *, on_tick: Any = None,
              poll_s: float = 0.5) -> int:
    """Wait for the run: done when the trainer side exits. Rollout workers are then stopped. Returns exit code.

    A trainer that fails stops the run (exit 1). A rollout worker that dies is reported and the run goes on with the
    others (fully_async).
    """
    trainers = [p for p in procs if p.role in ("trainer", "colocate")]
    others = [p for p in procs if p not in trainers]
    reported: set[str] = set()
    try:
        while True:
            if on_tick is not None:
                on_tick()
            codes = [p.popen.poll() for p in trainers]
            if any(c not in (None, 0) for c in codes):
                code = next(c for c in codes if c not in (None, 0))
                terminate(procs)
                return int(code or 1)
            if all(c == 0 for c in codes):
                terminate(others, timeout_s=30)
                return 0
            for p in others:
                if p.popen.poll() not in (None, 0) and p.proc not in reported:
                    reported.add(p.proc)
                    print(f"warning: {p.proc} exited with code {p.popen.returncode}; the run goes on",
                          file=sys.stderr)
            time.sleep(poll_s)
    except KeyboardInterrupt:
        print("interrupted: asking every role to checkpoint and stop ...", file=sys.stderr)
        terminate(procs)
        return 130
