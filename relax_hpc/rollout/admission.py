"""Admission control of the rollout workers of a run: no batch is generated that the trainer would drop as stale.

A batch started now is consumed after everything ahead of it: the groups in the store not yet planned (the backlog)
and the groups other workers are generating. A worker may start a batch of ``groups`` groups only while
``claimed by others + backlog + groups <= limit`` (``limit = max(max_staleness, 1) x prompts_per_step``), the
claims read before the store is listed. Before it generates, a worker writes its claim, ``claims/<proc>.json`` =
``{"groups", "time", "pid"}``; it removes the claim once the batch's shard is published (so, read in that order, the
groups are counted once, in the backlog, or twice for a moment: never zero times). Check and claim happen under a
best-effort lock (``claims/.lock``), so two workers do not both take the last room; where file locks do not work
the rule still holds approximately (a few stale groups, dropped and counted by the trainer). A claim older than
``max_age_s`` (a worker killed while generating) is ignored, and so at once is a claim of a process of this host
that is gone.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable

from relax_hpc.fsio import atomic_write_json, optional_lock, read_json
from relax_hpc.rundir import RunDir


class Admission:
    """One worker's side of admission control (see the module docstring)."""

    def __init__(self, run_dir: RunDir, proc: str, *, limit: int, max_age_s: float = 600.0):
        self.run_dir = run_dir
        self.proc = proc
        self.limit = limit
        self.max_age_s = max_age_s
        self.path = run_dir.claim_file(proc)
        self.held = 0
        run_dir.claims.mkdir(parents=True, exist_ok=True)
        self.release()  # a restarted worker's old claim

    def claimed_by_others(self) -> int:
        """Groups other workers are generating now (fresh claims only)."""
        total = 0
        now = time.time()
        try:
            names = os.listdir(self.run_dir.claims)
        except FileNotFoundError:
            return 0
        for name in names:
            if not name.endswith(".json") or name == self.path.name:
                continue
            with contextlib.suppress(OSError, ValueError):
                claim = read_json(self.run_dir.claims / name, default=None)
                if isinstance(claim, dict) and now - float(claim.get("time", 0)) <= self.max_age_s \
                        and not _dead_here(claim):
                    total += int(claim.get("groups", 0))
        return total

    def try_claim(self, groups: int, backlog_groups: Callable[[], int], *, more: bool = False) -> bool:
        """Claim room for a batch of ``groups`` groups if there is room now; True if claimed (or already held).
        ``more``: a further batch on top of the groups this worker holds (submitted while its batch in flight
        decodes its tail), claimed only while ``others + backlog + held + groups <= limit``.

        ``backlog_groups`` lists the store; it is called under the lock *after* the claims are read. A worker
        publishes its shard and then drops its claim, so in this order a batch is counted at least once; listing
        the store first could miss a shard published just after and then also miss its claim, dropped by then.
        """
        if self.held and not more:
            return True
        with optional_lock(self.run_dir.claims / ".lock", timeout_s=5.0):
            ahead = self.claimed_by_others()
            ahead += backlog_groups()
            if ahead + self.held + groups > (self.limit if self.held else max(self.limit, groups)):
                return False
            self._write(self.held + groups)
        self.held += groups
        return True

    def _write(self, groups: int) -> None:
        atomic_write_json(self.path, {"groups": groups, "time": time.time(), "pid": os.getpid(),
                                      "host": socket.gethostname()}, fsync=False, indent=None)

    def release(self, groups: int | None = None) -> None:
        """A batch is published (or abandoned): drop the claim, or only ``groups`` of it (one of several batches)."""
        self.held = 0 if groups is None else max(0, self.held - groups)
        if self.held:
            self._write(self.held)
            return
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _dead_here(claim: dict[str, object]) -> bool:
    """A claim written on this host by a process that is gone (a worker killed while generating): its groups are
    not coming, so they hold no room (a claim from another host is trusted until ``max_age_s``)."""
    if claim.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(claim.get("pid", 0)), 0)  # type: ignore[arg-type]
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, TypeError, OverflowError):
        return False
    return False

