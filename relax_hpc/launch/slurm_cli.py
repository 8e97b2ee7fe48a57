"""Thin, batched wrappers around Slurm's commands (sbatch, squeue, sacct, scancel, sinfo).

Every call has a timeout. Job states of many jobs come from ONE ``squeue`` and ONE ``sacct`` call (as submitit's
shared watcher does); a failing ``sacct`` (no accounting) is a warning, not an error. Errors of ``sbatch`` become one
line: sbatch's own message.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from relax_hpc.errors import UserError

log = logging.getLogger(__name__)

TIMEOUT_S = 30.0
ACTIVE_STATES = frozenset({"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING",
                           "COMPLETING", "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED",
                           "RESV_DEL_HOLD", "SPECIAL_EXIT"})


def run_slurm(argv: Sequence[str], *, timeout_s: float = TIMEOUT_S, env: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False,
                              env=None if env is None else {**os.environ, **env})
    except FileNotFoundError as exc:
        raise UserError(f"{argv[0]} not found: is Slurm installed here?") from exc
    except subprocess.TimeoutExpired as exc:
        raise UserError(f"`{' '.join(argv[:2])} ...` did not answer within {timeout_s:.0f}s") from exc


def _one_line(text: str, command: str) -> str:
    """Slurm's error output as one line, without the repeated ``sbatch: error:`` prefixes."""
    if "Could not establish a configuration source" in text:
        return "no Slurm configuration found here (is SLURM_CONF set? e.g. source /tmp/relax-slurm/slurm.env)"
    parts = []
    for line in text.splitlines():
        line = line.strip()
        for prefix in (f"{command}: error: ", f"{command}: "):
            if line.startswith(prefix):
                line = line[len(prefix):]
        if line and line not in parts:
            parts.append(line)
    return "; ".join(parts) or "(no message)"


def slurm_available(*, timeout_s: float = 5.0) -> bool:
    """True when ``sbatch`` is on PATH and the controller answers ``sinfo``."""
    return slurm_problem(timeout_s=timeout_s) is None


def slurm_problem(*, timeout_s: float = 5.0) -> str | None:
    """Why Slurm cannot be used here, or None when it can."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on PATH"
    try:
        res = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=timeout_s,
                             check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo failed: {exc}"
    if res.returncode != 0:
        return f"the Slurm controller does not answer: {_one_line(res.stderr, 'sinfo')}"
    return None


def sbatch(script: Path, *, extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> str:
    """Submit ``script`` with ``sbatch --parsable``; return the job id (the het leader's for a hetjob).

    Raises :class:`UserError` with sbatch's message on one line (an unknown partition, a bad time limit ...).
    """
    res = run_slurm(["sbatch", "--parsable", *extra_args, str(script)], env=env)
    if res.returncode != 0:
        raise UserError(f"sbatch rejected {script.name}: {_one_line(res.stderr, 'sbatch')}")
    job_id = res.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise UserError(f"sbatch printed no job id for {script.name}: {res.stdout.strip()!r}")
    return job_id


def scancel(job_ids: Iterable[str], *, signal: str | None = None, batch: bool = False) -> None:
    """Cancel (or signal) exactly these job ids in one call. Ids that already ended are not an error."""
    ids = [str(j) for j in job_ids]
    if not ids:
        return
    argv = ["scancel"]
    if signal:
        argv.append(f"--signal={signal}")
    if batch:
        argv.append("--batch")
    res = run_slurm([*argv, *ids])
    if res.returncode != 0:
        msg = _one_line(res.stderr, "scancel")
        if "already completed" not in msg and "Invalid job id" not in msg:
            raise UserError(f"scancel {' '.join(ids)}: {msg}")


def requeue(job_id: str) -> None:
    """``scontrol requeue JOB`` (what a preemption does to a job: SIGTERM to its steps, then it runs again)."""
    res = run_slurm(["scontrol", "requeue", str(job_id)])
    if res.returncode != 0:
        raise UserError(f"scontrol requeue {job_id}: {_one_line(res.stderr, 'scontrol')}")


@dataclass
class JobState:
    """State of one job, array task or het component, as squeue/sacct name it (``123``, ``123_4``, ``123+1``)."""

    job_id: str
    state: str
    reason: str = ""
    exit_code: str = ""
    elapsed: str = ""
    nodes: str = ""
    raw_id: str = ""
    source: str = "squeue"

    @property
    def active(self) -> bool:
        return self.state.split()[0] in ACTIVE_STATES if self.state else False


@dataclass
class JobQuery:
    """Result of :func:`query_jobs`: every row seen, and the warnings of a failed sacct."""

    rows: dict[str, JobState] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def of(self, job_id: str) -> list[JobState]:
        """Rows that belong to a recorded id: the job itself, its array tasks (``id_N``) or het parts (``id+N``)."""
        job_id = str(job_id)
        if job_id in self.rows:
            own = [self.rows[job_id]]
            if "_" in job_id or "+" in job_id:
                return own
        else:
            own = []
        subs = [r for k, r in self.rows.items() if k.startswith((f"{job_id}_", f"{job_id}+"))]
        return own + sorted(subs, key=lambda r: _sort_key(r.job_id))


def _sort_key(job_id: str) -> tuple[int, ...]:
    nums = [int(x) for x in job_id.replace("+", "_").replace("[", "_").replace("]", "").split("_") if x.isdigit()]
    return tuple(nums)


def query_jobs(job_ids: Iterable[str], *, use_sacct: bool = True) -> JobQuery:
    """States of many jobs with ONE ``squeue`` call and (optionally) ONE ``sacct`` call.

    squeue is the truth for jobs still known to the controller (array tasks expanded with ``-r``); sacct fills in
    the ones that ended. A job missing from both is reported as ``UNKNOWN``.
    """
    ids = sorted({str(j) for j in job_ids}, key=_sort_key)
    out = JobQuery()
    if not ids:
        return out
    res = run_slurm(["squeue", "-h", "-r", "-j", ",".join(ids), "-o", "%i|%T|%r|%M|%N|%A"])
    if res.returncode == 0:
        for line in res.stdout.splitlines():
            parts = line.strip().split("|")
            if len(parts) >= 6:
                out.rows[parts[0]] = JobState(parts[0], parts[1], reason=parts[2], elapsed=parts[3],
                                              nodes=parts[4], raw_id=parts[5], source="squeue")
    elif "Invalid job id" not in res.stderr:
        out.warnings.append(f"squeue failed: {_one_line(res.stderr, 'squeue')}")
    if use_sacct:
        res = run_slurm(["sacct", "-n", "-P", "-X", "-j", ",".join(ids), "-o",
                    "JobID,State,ExitCode,Elapsed,NodeList,JobIDRaw"])
        if res.returncode == 0:
            for line in res.stdout.splitlines():
                parts = line.strip().split("|")
                if len(parts) < 6:
                    continue
                known = out.rows.get(parts[0])
                if known is not None:
                    known.exit_code = parts[2]
                    continue
                if parts[1] in ACTIVE_STATES:  # sacct lags the controller; an active job not in squeue has ended
                    continue
                out.rows[parts[0]] = JobState(parts[0], parts[1], exit_code=parts[2], elapsed=parts[3],
                                              nodes=parts[4], raw_id=parts[5], source="sacct")
        else:
            out.warnings.append(f"sacct failed (is accounting enabled?): {_one_line(res.stderr, 'sacct')}")
    for j in ids:
        if not out.of(j):
            out.rows[j] = JobState(j, "UNKNOWN", source="none")
    return out
