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
from relax_hpc.roles import spec as roles
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
    """(role, rank) of every process the run needs (from the role table, :func:`relax_hpc.roles.spec.role_plan`)."""
    return roles.role_plan(cfg)


def start_role(run_dir: RunDir, cfg: RecipeConfig, role: str, rank: int, *, num_procs: int = 1) -> LocalProc:
    """Start one role process (``python -m relax_hpc role ...``). Threads per process are the role's
    ``cpus_per_task``, capped so that ``num_procs`` processes together do not oversubscribe this machine."""
    env = dict(os.environ)
    res = roles.resources(cfg, role)
    env.update(res.env)
    env.update(gpu_env(cfg, res.gpus, rank))
    env.update(thread_env(env, res.cpus_per_task, num_procs, os.cpu_count() or 1))
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


def thread_env(env: dict[str, str], cpus_per_task: int, num_procs: int, cores: int) -> dict[str, str]:
    """OpenMP settings of one of ``num_procs`` role processes on ``cores`` cores, where ``env`` does not set them:
    ``cpus_per_task`` threads, fewer where the processes together would oversubscribe the cores; and where they
    still do (more processes than cores), threads that sleep instead of spinning while they wait for work
    (``OMP_WAIT_POLICY=PASSIVE``: libgomp's spinning threads take the cores from the other processes, three
    2-thread torch processes on 2 cores ran 11x slower without it)."""
    fair = max(1, cores // max(1, num_procs))
    threads = int(env.get("OMP_NUM_THREADS") or max(1, min(cpus_per_task, fair)))
    out = {"OMP_NUM_THREADS": env.get("OMP_NUM_THREADS") or str(threads)}
    if num_procs * threads > cores and "OMP_WAIT_POLICY" not in env:
        out["OMP_WAIT_POLICY"] = "PASSIVE"
    return out


def gpu_env(cfg: RecipeConfig, gpus: list[int] | None, rank: int) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` (and ``RELAX_HPC_GPU``, the physical id) for rank ``rank`` of a role placed on
    ``gpus`` (``launch.<role>.gpus``): its GPU first, then every other id up to the highest either role names, so
    that ``cuda`` / ``cuda:0`` is its GPU while NCCL can still reach the others peer to peer. Empty for None."""
    if not gpus:
        return {}
    top = max(*(cfg.launch.trainer.gpus or [0]), *(cfg.launch.rollout.gpus or [0]))
    return cuda_visible(gpus[rank % len(gpus)], top)


def cuda_visible(own: int, top: int) -> dict[str, str]:
    """The environment of a process on GPU ``own`` of GPUs ``0..top``: ``own`` first, then the others in order."""
    order = [own, *(g for g in range(top + 1) if g != own)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, order)), "RELAX_HPC_GPU": str(own)}


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


class Interrupts:
    """Ctrl-C and SIGTERM to the launcher (:meth:`install` in the main thread). The first one stops the run: it
    raises ``KeyboardInterrupt`` where the launcher is, which asks every role to checkpoint and stop
    (:func:`terminate`). One more while they do kills them at once (their last complete checkpoint stands): it
    raises nothing, so the launcher never leaves before its roles. After :meth:`settle` (the run has stopped and
    its end is being recorded) signals are only counted."""

    def __init__(self) -> None:
        self.count = 0
        self.settled = False
        self.forced = False
        """Whether :func:`terminate` stopped the roles at once (they may not have finished checkpointing)."""
        self._old: dict[int, Any] = {}

    def handler(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 1 and not self.settled:
            raise KeyboardInterrupt

    def install(self) -> Interrupts:
        """Handle SIGTERM, and SIGINT unless it is ignored (a background job's: left as it is). Main thread only."""
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._old[sig] = signal.signal(sig, self.handler)
        return self

    def settle(self) -> None:
        self.settled = True

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()


def terminate(procs: list[LocalProc], *, timeout_s: float = 30.0, interrupts: Interrupts | None = None) -> None:
    """SIGTERM our processes (they checkpoint), then SIGKILL whatever is left after ``timeout_s``, or at once when
    ``interrupts`` counts another signal meanwhile (a second Ctrl-C). Returns when every process has exited."""
    for p in procs:
        if p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
    seen = interrupts.count if interrupts is not None else 0
    end = time.monotonic() + timeout_s
    while any(p.popen.poll() is None for p in procs) and time.monotonic() < end:
        if interrupts is not None and interrupts.count > seen:
            print("interrupted again: stopping the roles now (their last complete checkpoint stands)",
                  file=sys.stderr)
            interrupts.forced = True
            break
        time.sleep(0.05)
    for p in procs:
        if p.popen.poll() is None:
            p.popen.kill()
    for p in procs:
        p.popen.wait(timeout=10)


def record_restart(run_dir: RunDir, proc: LocalProc) -> None:
    """Point the launch record's entry of ``proc`` at its new pid (status and cancel act on live pids only)."""
    rec = read_json(run_dir.launch_record, default={}, expect=dict) or {}
    entries = [e for e in rec.get("procs", []) if not (isinstance(e, dict) and e.get("proc") == proc.proc)]
    entries.append({"role": proc.role, "rank": proc.rank, "proc": proc.proc, "pid": proc.popen.pid,
                    "host": os.uname().nodename, "started": time.time()})
    atomic_write_json(run_dir.launch_record, {**rec, "executor": "local", "procs": entries})


def _slots(run_dir: RunDir, cfg: RecipeConfig, procs: list[LocalProc]) -> list[Any]:
    """A supervisor slot per process; a restart starts the role again and updates ``procs`` and launch.json."""
    from relax_hpc.launch.supervisor import Slot, group_for, policy_for

    def starter(p: LocalProc) -> Callable[[], subprocess.Popen[bytes]]:
        def start() -> subprocess.Popen[bytes]:
            new = start_role(run_dir, cfg, p.role, p.rank, num_procs=len(procs))
            p.popen = new.popen
            record_restart(run_dir, p)
            return new.popen
        return start

    return [Slot(run_dir, p.role, p.rank, policy_for(cfg, roles.role_spec(p.role)), starter(p), popen=p.popen,
                 group=group_for(run_dir, cfg, roles.role_spec(p.role))) for p in procs]


def await_helpers(helpers: list[LocalProc], grace_s: Callable[[LocalProc], float],
                  interrupts: Interrupts | None) -> None:
    """The trainer has finished: wait for the rollout workers to end by themselves, each up to ``grace_s(proc)``
    (they see the run complete; the evaluating one evaluates the final weights first), as the Slurm job's script
    does; a Ctrl-C or SIGTERM meanwhile stops the waiting (the caller then stops them)."""
    seen = interrupts.count if interrupts is not None else 0
    t0 = time.monotonic()
    ends = {id(p): t0 + grace_s(p) for p in helpers}
    said = False
    try:
        while True:
            now = time.monotonic()
            waiting = [p for p in helpers if p.popen.poll() is None and now < ends[id(p)]]
            if not waiting or (interrupts is not None and interrupts.count > seen):
                return
            if not said and now - t0 > 5:
                said = True
                print(f"the trainer has finished; waiting for {', '.join(p.proc for p in waiting)} to end "
                      "(the final evaluation) ...", file=sys.stderr)
            time.sleep(0.2)
    except KeyboardInterrupt:
        return


def supervise(run_dir: RunDir, cfg: RecipeConfig, procs: list[LocalProc], *, on_tick: Any = None,
              poll_s: float = 0.5, interrupts: Interrupts | None = None) -> int:
    """Wait for the run: done when the trainer side exits. Rollout workers are then stopped. Returns exit code.

    Dead processes are restarted by the role supervisor (:mod:`relax_hpc.launch.supervisor`: a killed or hung
    trainer resumes from its newest complete checkpoint, a dead rollout worker rejoins), with backoff and a cap
    per role. A trainer that fails for good stops the run (its exit code); a rollout worker that does is reported
    and the run goes on with the others. When every rollout worker has stopped for good on a user error (exit 2:
    bad input, e.g. an inference server that cannot start), nothing would ever feed the trainer, so the run stops
    (the trainer checkpoints on SIGTERM) and the exit code is 2. ``interrupts``: the launcher's signal counter
    (:class:`Interrupts`): a second Ctrl-C or SIGTERM while the roles checkpoint stops them at once.
    """
    slots = _slots(run_dir, cfg, procs)
    trainers = [s for s in slots if roles.is_trainer_side(s.role)]
    others = [s for s in slots if s not in trainers]
    reported: set[str] = set()
    try:
        while True:
            if on_tick is not None:
                on_tick()
            for s in slots:
                s.step()
            codes = [s.final for s in trainers]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                terminate(procs, interrupts=interrupts)
                return int(failed[0] or 1)
            if all(c == 0 for c in codes):
                helpers = [p for p in procs if not roles.is_trainer_side(p.role)]
                await_helpers(helpers, lambda p: roles.rollout_grace_s(cfg, p.role, p.rank), interrupts)
                terminate(helpers, timeout_s=30, interrupts=interrupts)
                return 0
            for s in others:
                if s.final not in (None, 0) and s.proc not in reported:
                    reported.add(s.proc)
                    print(f"warning: {s.proc} exited with code {s.final}; the run goes on", file=sys.stderr)
            if others and all(s.final == 2 for s in others):
                print("error: every rollout worker stopped on a user error (above); stopping the run",
                      file=sys.stderr)
                terminate(procs, interrupts=interrupts)
                return 2
            time.sleep(poll_s)
    except KeyboardInterrupt:
        print("interrupted: asking every role to checkpoint and stop (interrupt again to stop them now) ...",
              file=sys.stderr)
        terminate(procs, interrupts=interrupts)
        return 130
    finally:
        for s in slots:
            s.log.close()
