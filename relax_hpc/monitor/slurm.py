"""Best-effort Slurm job states for the monitor: one batched ``squeue`` call at most every ``min_interval_s``.

``squeue`` missing, failing or slow never breaks the monitor: the states are then simply unknown. A job that has
left the queue (finished long enough ago) is not listed by ``squeue`` and reads as unknown too.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)


def parse_squeue(text: str) -> dict[str, str]:
    """Parse ``squeue -h -o '%i %A %T'`` (or ``'%i %T'``) output into job id -> state.

    Both the display id (``123_4`` for an array task) and the raw id (``%A``) map to the state, so a role can be
    matched by ``SLURM_JOB_ID`` or by ``<array job>_<task>``.
    """
    states: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        state = parts[-1]
        for job_id in parts[:-1]:
            states[job_id] = state
    return states


class SlurmPoller:
    """Caches job states; :meth:`states` calls ``squeue`` only when the cache is older than ``min_interval_s``."""

    def __init__(self, *, min_interval_s: float = 10.0, timeout_s: float = 5.0, squeue: str = "squeue"):
        self.min_interval_s = min_interval_s
        self.timeout_s = timeout_s
        self.squeue = squeue
        self.calls = 0
        """How many times ``squeue`` ran (tests and the benchmark read it)."""
        self._last = -float("inf")
        self._ids: tuple[str, ...] = ()
        self._states: dict[str, str] = {}
        self._missing_logged = False

    def states(self, job_ids: Iterable[str]) -> dict[str, str]:
        """Job id -> Slurm state (``RUNNING``, ``PENDING`` ...) for the ids ``squeue`` still lists."""
        ids = tuple(sorted({str(j) for j in job_ids if str(j)}))
        if not ids:
            return {}
        now = time.monotonic()
        if ids == self._ids and now - self._last < self.min_interval_s:
            return self._states
        self._ids, self._last = ids, now
        self._states = self._query(ids)
        return self._states

    def _query(self, ids: tuple[str, ...]) -> dict[str, str]:
        exe = shutil.which(self.squeue)
        if exe is None:
            if not self._missing_logged:
                log.debug("squeue not found; Slurm job states are not shown")
                self._missing_logged = True
            return {}
        self.calls += 1
        try:
            proc = subprocess.run([exe, "-h", "-j", ",".join(ids), "-o", "%i %A %T"], capture_output=True,
                                  text=True, timeout=self.timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.debug("squeue failed: %s", exc)
            return {}
        # squeue exits 1 when every id is unknown (all jobs left the queue): that is "no states", not an error.
        return parse_squeue(proc.stdout)
