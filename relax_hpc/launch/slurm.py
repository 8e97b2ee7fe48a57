"""Launch a run on Slurm: render its sbatch scripts, submit them with ``sbatch --parsable``, record the job ids.

Our own scripts, not submitit's executor: submitit pickles the callable and its result into the job folder on the
shared filesystem and unpickles them on the nodes, which would let anyone who can write the run dir run code in our
jobs. The jobs run plain role entry points (``python -m relax_hpc role ... --run-dir RUN_DIR``) that read the run
dir's ``config.json``.

``launch.json`` (:attr:`RunDir.launch_record`)::

    {"executor": "slurm", "mode": "fully_async", "placement": "separate", "submitted": 1700000000.0,
     "jobs": [{"job_id": "123", "kind": "trainer", "role": "trainer", "roles": ["trainer"], "script": "...",
               "ranks": []},
              {"job_id": "124", "kind": "rollout_array", "role": "rollout", "roles": ["rollout"], "ranks": [0, 1]}],
     "retired": [1],            # rollout ranks drained by `relax-hpc scale`
     "history": [...]}          # the jobs of earlier submissions of the same run dir (`relax-hpc resume`)
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.errors import UserError
from relax_hpc.fsio import atomic_write_json, atomic_write_text, read_json
from relax_hpc.launch import slurm_cli
from relax_hpc.launch.sbatch import JobScript, as_run_dir, render_run
from relax_hpc.launch.slurm_cli import slurm_available
from relax_hpc.launch.slurm_time import time_limit_warnings
from relax_hpc.roles import spec as roles
from relax_hpc.rundir import RunDir, proc_name

log = logging.getLogger(__name__)

__all__ = ["launch", "read_launch_record", "request_drain", "run_finished", "slurm_available", "submit_scripts"]


def require_slurm() -> None:
    """Raise a one-line :class:`UserError` when this machine cannot submit Slurm jobs."""
    problem = slurm_cli.slurm_problem()
    if problem:
        raise UserError(f"--executor slurm: no usable Slurm here ({problem}); use --executor local, or start a "
                        "single-machine cluster with tools/slurm_local.sh start")


def read_launch_record(run_dir: RunDir | Path | str) -> dict[str, Any]:
    """The run's ``launch.json`` ({} when nothing was launched yet)."""
    rd = as_run_dir(run_dir)
    try:
        rec = read_json(rd.launch_record, default={}, expect=dict)
    except ValueError as exc:
        raise UserError(f"{rd.launch_record} is not valid JSON: {exc}") from None
    return rec if isinstance(rec, dict) else {}


def write_launch_record(run_dir: RunDir | Path | str, record: dict[str, Any]) -> None:
    atomic_write_json(as_run_dir(run_dir).launch_record, record)


def request_drain(run_dir: RunDir | Path | str, proc: str) -> Path:
    """Ask one rollout worker (``rollout-3``) to finish its current batch and exit 0. Returns the control file."""
    rd = as_run_dir(run_dir)
    path = rd.control_file(proc)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"action": "drain", "time": time.time()})
    return path


def clear_drain(run_dir: RunDir | Path | str, proc: str) -> None:
    """Remove a drain request (before a rank is started again, e.g. by ``resume``)."""
    with contextlib.suppress(FileNotFoundError):
        as_run_dir(run_dir).control_file(proc).unlink()


def _job_entry(script: JobScript, job_id: str, rd: RunDir) -> dict[str, Any]:
    return {"job_id": job_id, "kind": script.kind, "role": script.roles[0], "roles": list(script.roles),
            "script": str(rd.slurm_script(script.name)), "ranks": list(script.ranks), "submitted": time.time()}


def submit_scripts(rd: RunDir, scripts: Sequence[JobScript], *, sbatch_args: Sequence[str] = ()
                   ) -> list[dict[str, Any]]:
    """Write ``scripts`` into ``RUN_DIR/slurm`` and submit them in order. If one is rejected, the jobs already
    submitted by this call are cancelled (by id) and the rejection is raised as one line."""
    rd.slurm.mkdir(parents=True, exist_ok=True)
    entries: list[dict[str, Any]] = []
    for script in scripts:
        path = rd.slurm_script(script.name)
        atomic_write_text(path, script.text)
        path.chmod(0o755)
        try:
            job_id = slurm_cli.sbatch(path, extra_args=sbatch_args)
        except UserError:
            if entries:
                slurm_cli.scancel([e["job_id"] for e in entries])
            raise
        entries.append(_job_entry(script, job_id, rd))
        log.info("submitted %s as Slurm job %s", path.name, job_id)
    return entries


def launch(run_dir: RunDir | Path | str, cfg: RecipeConfig, *, dry_run: bool = False,
           rollout_ranks: Sequence[int] | None = None, python: str | None = None,
           sbatch_args: Sequence[str] = ()) -> dict[str, Any]:
    """Render, submit and record a whole run (the run dir and its ``config.json`` must exist unless ``dry_run``).

    Returns the launch record (also written to ``launch.json``); with ``dry_run``, ``{"dry_run": True, "scripts":
    [{"name", "kind", "text"}...], "warnings": [...]}`` and nothing is written or submitted. Earlier jobs of the
    same run dir (a resume) move to ``history``. Warns when the time limit looks short for the checkpoint interval.
    """
    rd = as_run_dir(run_dir)
    scripts = render_run(rd, cfg, python=python, rollout_ranks=rollout_ranks)
    warnings = time_limit_warnings(cfg, rd)
    for w in warnings:
        log.warning("%s", w)
    if dry_run:
        for s in scripts:
            if rd.slurm.is_dir():  # `submit --dry-run` made the run dir: leave the scripts there, ready for sbatch
                atomic_write_text(rd.slurm_script(s.name), s.text)
            print(f"# ---- {rd.slurm_script(s.name)} ({s.kind}; not submitted)\n{s.text}", end="")
        return {"executor": "slurm", "dry_run": True, "warnings": warnings, "jobs": [],
                "scripts": [{"name": s.name, "kind": s.kind, "roles": list(s.roles),
                             "path": str(rd.slurm_script(s.name)), "text": s.text} for s in scripts]}
    require_slurm()
    if not rd.config.is_file():
        raise UserError(f"{rd.config} is missing: the roles read the resolved config from there")
    previous = read_launch_record(rd)
    elastic = roles.mode_spec(cfg).elastic
    for s in scripts:  # ranks started again must not obey an old drain request
        for r in s.ranks if elastic is not None and elastic.name in s.roles else ():
            clear_drain(rd, proc_name(elastic.name, r))
    entries = submit_scripts(rd, scripts, sbatch_args=sbatch_args)
    history = list(previous.get("history", []))
    if previous.get("jobs"):
        history.append({"submitted": previous.get("submitted"), "executor": previous.get("executor"),
                        "jobs": previous.get("jobs")})
    record = {"executor": "slurm", "mode": cfg.mode, "placement": roles.placement(cfg),
              "submitted": time.time(), "jobs": entries, "retired": [], "history": history, "warnings": warnings}
    write_launch_record(rd, record)
    return record


def run_finished(run_dir: RunDir | Path | str) -> bool | None:
    """None while the run is going on; then True if it completed (``STATUS.json``), False otherwise.

    A completed trainer ends the run even while rollout jobs are still winding down; otherwise the run is over
    when none of its recorded jobs is active (pending, running, requeued ...) any more.
    """
    rd = as_run_dir(run_dir)
    final = read_json(rd.status_file, default=None)
    if isinstance(final, dict) and final.get("state") == "completed":
        return True
    rec = read_launch_record(rd)
    ids = [e["job_id"] for e in rec.get("jobs", [])]
    if ids:
        q = slurm_cli.query_jobs(ids, use_sacct=False)
        if any(r.active for j in ids for r in q.of(j)):
            return None
    final = read_json(rd.status_file, default=None)
    return isinstance(final, dict) and final.get("state") == "completed"
