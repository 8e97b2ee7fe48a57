"""The role supervisor: watch every role process and its heartbeat; restart a dead one with backoff and a cap.

What the launchers share (the local executor's wait loop, :func:`relax_hpc.launch.local.supervise`, and the Slurm
job steps, which run each task as ``relax-hpc role ROLE --supervise``, :func:`run_supervised`):

* A process is *dead* when a signal ended it (``SIGKILL``, the OOM killer), when its heartbeat (the one carrying its
  pid) is older than ``monitor.dead_after_s`` (hung: it is then ``SIGKILL``\\ed), or, for a role whose
  :attr:`RoleSpec.restart` is ``failed`` (the stateless rollout workers), when it exits with a failing status.
  Exit 0 (done), 2 (bad input) and 3 (checkpointed after SIGTERM/SIGUSR2) are never restarted, nor anything once
  the run has its ``STATUS.json``.
* A dead process is started again after ``restart_backoff_s`` (doubling per restart of the same rank, at most
  ``restart_backoff_max_s``), at most ``max_restarts`` times (the role's ``launch`` section). A restarted trainer
  resumes from its newest complete checkpoint by itself; a restarted rollout worker rejoins at the latest snapshot
  with a new writer id.
* A role whose ranks form a process group (a trainer of several ranks) restarts as a whole: the supervisor of a
  rank that died raises the group's restart generation (``supervisor/groups/<group>.json``,
  :class:`GroupRestarts`); every rank's supervisor that sees a newer generation stops its rank by pid (``SIGKILL``:
  a survivor would hang in a collective with its dead peer) and starts it again after its backoff, so all ranks
  meet again at a new rendezvous and resume from the newest complete checkpoint. A rank that exits with a failing
  status (a survivor whose collective failed) waits ``GROUP_GRACE_S`` for such a generation before it counts as
  failed. This works the same for the local executor (all slots in one process) and on Slurm (one supervisor per
  task, possibly on other nodes: they meet through the run dir).
* Each restart is recorded in ``supervisor/<proc>.json`` (:meth:`RunDir.restarts_file`, one writer: the process's
  supervisor), as an ``alert`` (``role_restarted``; ``restarts_exhausted`` when the cap is reached) and as a
  ``supervisor/restarts`` metric in the supervisor's event log ``logs/events/supervisor_<role>-<rank>.jsonl``.
  ``relax-hpc status`` shows the counts.

On Slurm, a rollout task whose process dies therefore no longer ends its job: its supervisor, the task srun
started, starts the worker again, and signals from Slurm (scancel, requeue, the time limit) are passed on to it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from relax_hpc.events import EventLog
from relax_hpc.fsio import atomic_write_json, read_json
from relax_hpc.lifecycle import EXIT_FAILED, EXIT_OK, EXIT_REQUEUE, EXIT_USER_ERROR
from relax_hpc.roles import spec as roles
from relax_hpc.roles.spec import Restart, RoleSpec
from relax_hpc.rundir import RunDir, proc_name

log = logging.getLogger(__name__)

NEVER_RESTARTED = (EXIT_OK, EXIT_USER_ERROR, EXIT_REQUEUE)
"""Exit statuses that end a process for good: done, bad input, checkpointed after a signal."""
State = Literal["running", "waiting", "ended"]
GROUP_GRACE_S = 10.0
"""How long a rank of a process group that exited with a failing status waits for a group restart (its peer's death
is noticed by another supervisor, through the run dir) before it counts as failed."""


@dataclass(frozen=True)
class RestartPolicy:
    """When and how soon a dead process of one role is started again (from the role table and its config)."""

    on: Restart
    max_restarts: int
    backoff_s: float
    backoff_max_s: float
    hang_after_s: float | None
    """A live process whose heartbeat is older than this is hung (None: heartbeats are not watched)."""

    def delay(self, n: int) -> float:
        """Seconds to wait before restart number ``n`` (1 = the first) of one rank."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, n - 1))

    def reason(self, code: int) -> str | None:
        """Why a process that ended with ``code`` (``-N``: signal N) is to be restarted; None: it is not."""
        if code < 0:
            return f"killed by {signal_name(-code)}"
        if code in NEVER_RESTARTED or self.on == "killed":
            return None
        return f"exit status {code}"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def policy_for(cfg: Any, spec: RoleSpec) -> RestartPolicy:
    """The restart policy of ``spec`` in the run of ``cfg``."""
    res = roles.resources(cfg, spec)
    return RestartPolicy(spec.restart, res.max_restarts, res.restart_backoff_s, res.restart_backoff_max_s,
                         float(cfg.monitor.dead_after_s))


def group_for(run_dir: RunDir, cfg: Any, spec: RoleSpec) -> GroupRestarts | None:
    """The restart generation of ``spec``'s process group when its ranks form one (None: they restart alone)."""
    if spec.group is None or roles.num_ranks(cfg, spec) == 1:
        return None
    return GroupRestarts(run_dir, spec.group)


class GroupRestarts:
    """The restart generation of one process group, ``supervisor/groups/<group>.json`` (module docstring). Several
    supervisors may raise it at once: each writes ``seen + 1`` atomically, so they agree on the value."""

    def __init__(self, run_dir: RunDir, group: str):
        self.run_dir, self.group = run_dir, group
        self.path = run_dir.group_restart_file(group)

    def read(self) -> dict[str, Any]:
        try:
            rec = read_json(self.path, default=None, expect=dict) or {}
        except (OSError, ValueError):
            rec = {}
        return rec if isinstance(rec.get("generation"), int) else {}

    def generation(self) -> int:
        return int(self.read().get("generation", 0))

    def request(self, seen: int, proc: str, reason: str) -> int:
        """Ask every rank to restart (``proc`` died: ``reason``) unless a generation after ``seen`` is already
        asked for; returns the generation to restart into."""
        current = self.generation()
        if current > seen:
            return current
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.path, {"group": self.group, "generation": seen + 1, "by": proc, "reason": reason,
                                      "time": time.time()})
        return seen + 1


def heartbeat_age(run_dir: RunDir, proc: str, pid: int, *, now: float | None = None) -> float | None:
    """Age of ``proc``'s heartbeat when it is the one of process ``pid`` and not a final one (None otherwise:
    none yet, another incarnation's, stopped, or unreadable)."""
    try:
        hb = read_json(run_dir.heartbeat(proc), default=None, expect=dict)
    except (OSError, ValueError):
        return None
    if not hb or hb.get("pid") != pid or hb.get("state") in ("stopped", "failed"):
        return None
    t = hb.get("time")
    if not isinstance(t, int | float):
        return None
    return max(0.0, (time.time() if now is None else now) - float(t))


class RestartLog:
    """The restart record of one process: ``supervisor/<proc>.json``, alerts and metrics (module docstring).
    Counts add up over supervisor incarnations (a resumed or requeued run); the cap is per incarnation."""

    def __init__(self, run_dir: RunDir, role: str, rank: int):
        self.run_dir, self.role, self.rank = run_dir, role, rank
        self.proc = proc_name(role, rank)
        try:
            old = read_json(run_dir.restarts_file(self.proc), default=None, expect=dict) or {}
        except (OSError, ValueError):
            old = {}
        self.total = int(old.get("restarts", 0)) if isinstance(old.get("restarts"), int) else 0
        self.history: list[dict[str, Any]] = [h for h in old.get("history", []) if isinstance(h, dict)][-50:]
        self._events: EventLog | None = None

    @property
    def events(self) -> EventLog:
        if self._events is None:
            self._events = EventLog(self.run_dir, f"supervisor_{self.role}", self.rank)
        return self._events

    def _write(self, **extra: Any) -> None:
        self.run_dir.supervisor.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.run_dir.restarts_file(self.proc), {
            "proc": self.proc, "role": self.role, "rank": self.rank, "restarts": self.total,
            "history": self.history, "time": time.time(), **extra})

    def restarted(self, reason: str, n: int, limit: int, pid: int) -> None:
        """Record restart ``n`` (of at most ``limit``) of this process, now running as ``pid``."""
        self.total += 1
        self.history = [*self.history, {"time": time.time(), "reason": reason, "pid": pid}][-50:]
        self._write()
        msg = f"{self.proc} {reason}: restarted ({n} of at most {limit} restarts here; {self.total} in this run)"
        log.warning("%s", msg)
        with contextlib.suppress(OSError):
            self.events.alert("role_restarted", msg, target=self.proc, reason=reason, restarts=self.total, pid=pid)
            self.events.metrics({"supervisor/restarts": self.total, f"supervisor/restarts_{self.role}": self.total})

    def exhausted(self, reason: str, limit: int) -> None:
        msg = f"{self.proc} {reason}: not restarted, it was restarted {limit} times already (max_restarts)"
        log.error("%s", msg)
        with contextlib.suppress(OSError):
            self._write(gave_up=reason)
            self.events.alert("restarts_exhausted", msg, target=self.proc, reason=reason, restarts=self.total)

    def close(self) -> None:
        if self._events is not None:
            self._events.close()


@dataclass
class Slot:
    """One supervised process: how to start it, its policy, its restarts; :meth:`step` advances it."""

    run_dir: RunDir
    role: str
    rank: int
    policy: RestartPolicy
    start: Callable[[], subprocess.Popen[bytes]]
    popen: subprocess.Popen[bytes] | None = None
    group: GroupRestarts | None = None
    """The process group the rank belongs to (None: it restarts alone)."""
    restarts: int = 0
    """Restarts by this supervisor."""
    due: float | None = None
    """When (``time.monotonic()``) a dead process starts again; None: not waiting."""
    why: str = ""
    final: int | None = None
    """The exit status once the process ended for good (None while it runs or waits for a restart)."""
    log: RestartLog = field(init=False)
    generation: int = field(init=False, default=0)
    """The group's restart generation the running process belongs to."""
    failed_code: int | None = field(init=False, default=None)
    grace_until: float | None = field(init=False, default=None)
    """A rank of a group that exited failing: when it counts as failed unless its group restarts first."""

    def __post_init__(self) -> None:
        self.log = RestartLog(self.run_dir, self.role, self.rank)
        if self.group is not None:
            self.generation = self.group.generation()

    @property
    def proc(self) -> str:
        return proc_name(self.role, self.rank)

    @property
    def state(self) -> State:
        if self.final is not None:
            return "ended"
        return "waiting" if self.due is not None or self.grace_until is not None else "running"

    def step(self, now: float | None = None) -> State:
        """Look at the process once: notice a death, hang or exit (or its group's restart); start it again when its
        backoff is over."""
        now = time.monotonic() if now is None else now
        if self.final is not None:
            return "ended"
        if self.due is not None:
            if now >= self.due:
                self._restart()
            return self.state
        if self.grace_until is not None:
            self._grace(now)
            return self.state
        assert self.popen is not None, "a slot that is neither waiting nor ended has a process"
        code = self.popen.poll()
        hang = ""
        if code is None:
            if self._group_restarted(now):
                return self.state
            hang = self._hung()
            if not hang:
                return "running"
            self._kill()
            code = self.popen.wait(timeout=30)
        self._ended(code, hang, now)
        return self.state

    def _kill(self) -> None:
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()

    def _hung(self) -> str:
        after = self.policy.hang_after_s
        if after is None or self.popen is None:
            return ""
        age = heartbeat_age(self.run_dir, self.proc, self.popen.pid)
        return f"silent (no heartbeat for {age:.0f}s)" if age is not None and age > after else ""

    def _group_restarted(self, now: float) -> bool:
        """If another rank of the group died (a newer generation): stop this rank by pid and restart it too."""
        if self.group is None:
            return False
        rec = self.group.read()
        gen = int(rec.get("generation", 0))
        if gen <= self.generation:
            return False
        if self.popen is not None and self.popen.poll() is None:
            self._kill()
            self.popen.wait(timeout=30)
        self._schedule(f"{rec.get('by', 'a rank')} {rec.get('reason', 'died')}: the {self.group.group} group "
                       f"restarts", EXIT_FAILED, now)
        self.generation = gen
        return True

    def _grace(self, now: float) -> None:
        assert self.grace_until is not None and self.failed_code is not None
        if self._group_restarted(now):
            self.grace_until = None
        elif now >= self.grace_until:
            self.grace_until, self.final = None, self.failed_code

    def _ended(self, code: int, hang: str, now: float) -> None:
        reason = hang or self.policy.reason(code)
        if reason is None or self.run_dir.status_file.exists():
            if self.group is not None and code not in NEVER_RESTARTED and not self.run_dir.status_file.exists():
                self.failed_code, self.grace_until = code, now + GROUP_GRACE_S  # maybe a peer died first
                self._grace(now)
                return
            self.final = code
            return
        if self.group is not None:
            self.generation = self.group.request(self.generation, self.proc, reason)
        self._schedule(reason, code, now)

    def _schedule(self, reason: str, code: int, now: float) -> None:
        if self.run_dir.status_file.exists():
            self.final = code if code >= 0 else EXIT_FAILED
            return
        if self.restarts >= self.policy.max_restarts:
            self.log.exhausted(reason, self.policy.max_restarts)
            self.final = code if code > 0 else EXIT_FAILED
            return
        self.why = reason
        self.due = now + self.policy.delay(self.restarts + 1)

    def _restart(self) -> None:
        self.due = None
        if self.run_dir.status_file.exists():  # the run ended meanwhile
            self.final = EXIT_OK
            return
        if self.group is not None:  # a death noticed while this rank waited is answered by this start too
            self.generation = max(self.generation, self.group.generation())
        self.restarts += 1
        self.popen = self.start()
        self.log.restarted(self.why, self.restarts, self.policy.max_restarts, self.popen.pid)

    def give_up(self, code: int) -> None:
        """Stop waiting for a restart (the supervisor was asked to stop); the slot ends with ``code``."""
        self.due = self.grace_until = None
        self.final = code


# ------------------------------------------------------------------------------------------------ Slurm tasks
def role_command(run_dir: RunDir, role: str, rank: int) -> list[str]:
    """The command of one role process (what the supervisor starts and restarts)."""
    return [sys.executable, "-m", "relax_hpc", "role", role, "--run-dir", str(run_dir.root), "--rank", str(rank)]


class _Forward:
    """Pass SIGTERM/SIGUSR2/SIGINT on to the supervised process (Slurm signals this task: scancel, requeue, the
    time limit); the first one also stops restarts."""

    def __init__(self, slot: Slot):
        self.slot = slot
        self.signum: int | None = None
        for s in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
            signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        p = self.slot.popen
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signum)


def run_supervised(run_dir_path: str | Path, role: str, rank: int, *, poll_s: float = 0.25) -> int:
    """Run one role process under a supervisor (a Slurm task). Returns the exit status of the task: the process's
    last one (3 when it was signalled and checkpointed), 1 when it died and was not restarted."""
    from relax_hpc.roles.entry import load_run_config

    rd = RunDir.open(run_dir_path)
    spec = roles.role_spec(role)
    cfg = load_run_config(rd)
    cmd = role_command(rd, role, rank)
    slot = Slot(rd, role, rank, policy_for(cfg, spec), lambda: subprocess.Popen(cmd, stdin=subprocess.DEVNULL),
                group=group_for(rd, cfg, spec))
    fwd = _Forward(slot)
    slot.popen = slot.start()
    try:
        while slot.step() != "ended":
            if fwd.signum is not None and slot.state == "waiting":
                slot.give_up(EXIT_REQUEUE)  # signalled while dead: nothing left to checkpoint
                break
            time.sleep(poll_s)
    finally:
        slot.log.close()
        p = slot.popen
        if p is not None and p.poll() is None:  # an exception here: do not leave the process behind
            p.kill()
            p.wait(timeout=30)
    code = int(slot.final if slot.final is not None else EXIT_FAILED)
    return code if code >= 0 else EXIT_FAILED
