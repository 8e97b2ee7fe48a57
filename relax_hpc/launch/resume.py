"""Resubmit a stopped run into the same run dir; the trainer resumes from its latest checkpoint by itself.

Refused while any recorded job or process of the run is still active, and for a completed run. The rollout ranks
that were running (launched minus retired) are started again; a failed ``STATUS.json`` is moved into the launch
record's history so that the new incarnation does not read it as the end of the run.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from relax_hpc.config.load import validate_resolved
from relax_hpc.errors import ConfigError, UserError
from relax_hpc.fsio import check_writable, read_json
from relax_hpc.launch import slurm_cli
from relax_hpc.launch.checks import check_plugins
from relax_hpc.launch.runctl import proc_alive
from relax_hpc.launch.slurm import launch, read_launch_record, write_launch_record
from relax_hpc.roles import spec as roles
from relax_hpc.rundir import RunDir


def _still_active(rec: dict[str, Any]) -> list[str]:
    active = []
    if rec.get("executor") == "slurm" and rec.get("jobs"):
        q = slurm_cli.query_jobs([e["job_id"] for e in rec["jobs"]], use_sacct=False)
        active += [f"{r.job_id} ({r.state})" for e in rec["jobs"] for r in q.of(e["job_id"]) if r.active]
    active += [f"pid {p.get('pid')}" for p in rec.get("procs", []) or [] if proc_alive(p)]
    return active


def resume_ranks(rec: dict[str, Any]) -> list[int] | None:
    """Ranks of the elastic role (rollout workers) to start again: every rank launched so far minus the retired
    ones (None: the default)."""
    ranks = roles.elastic_ranks(rec.get("jobs", []))
    ranks -= {int(r) for r in rec.get("retired", [])}
    return sorted(ranks) or None


def resume_run(run_dir: RunDir | Path | str, *, executor: str | None = None, dry_run: bool = False
               ) -> dict[str, Any]:
    """Resubmit ``run_dir`` (executor: the recorded one unless given). Returns the new launch record."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir.open(run_dir)
    if not dry_run:
        check_writable(rd.root, "run dir:")  # a read-only mount: one line now, not a role failing later
    if not rd.config.is_file():
        raise UserError(f"{rd.config} is missing: this run dir was never submitted")
    try:
        cfg = check_plugins(validate_resolved(read_json(rd.config, expect=dict)))
    except ValueError as exc:
        problems = exc.problems if isinstance(exc, ConfigError) else [str(exc)]
        raise UserError(f"{rd.config} does not validate any more: {'; '.join(problems)}") from None
    rec = read_launch_record(rd)
    final = read_json(rd.status_file, default=None, expect=dict)
    if isinstance(final, dict) and final.get("state") == "completed":
        raise UserError(f"run {rd.root} already completed (STATUS.json); nothing to resume")
    busy = _still_active(rec)
    if busy:
        raise UserError(f"run {rd.root} is still active: {', '.join(busy)}; wait, or `relax-hpc cancel` it first")
    executor = executor or rec.get("executor") or cfg.launch.executor
    if executor == "auto":
        executor = "slurm" if slurm_cli.slurm_available() else "local"
    if dry_run:
        if executor != "slurm":
            raise UserError("--dry-run shows sbatch scripts: it needs --executor slurm")
        return launch(rd, cfg, dry_run=True, rollout_ranks=resume_ranks(rec))
    if final is not None and not dry_run:
        rec.setdefault("previous_status", []).append(final)
        write_launch_record(rd, rec)
        with contextlib.suppress(FileNotFoundError):
            rd.status_file.unlink()
    if executor == "slurm":
        new = launch(rd, cfg, rollout_ranks=resume_ranks(rec) if roles.mode_spec(cfg).elastic else None)
        if rec.get("previous_status"):
            new["previous_status"] = rec.get("previous_status", [])
            write_launch_record(rd, new)
        return new
    try:
        from relax_hpc.launch import local
    except ImportError:
        raise UserError("the local executor is not available in this installation") from None
    return local.launch(rd, cfg)
