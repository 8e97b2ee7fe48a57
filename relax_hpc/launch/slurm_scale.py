"""Elastic rollout on Slurm: add workers as new array jobs with new ranks, or drain and cancel some, while the
trainer goes on.

* Up (placement ``separate``): a new job array whose task ids are fresh ranks (never reused); the new workers start
  from the latest weight snapshot by themselves.
* Down: pending workers are cancelled at once; running ones get a drain request (``request_drain``: finish the
  current batch, exit 0) and are cancelled by task id if they have not ended after ``timeout_s``. Highest ranks go
  first. In placement ``hetjob`` the rollout group is fixed: workers can be drained, not added.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relax_hpc.config.load import validate_resolved
from relax_hpc.errors import UserError
from relax_hpc.fsio import read_json
from relax_hpc.launch import slurm_cli
from relax_hpc.launch.sbatch import render_rollout_array
from relax_hpc.launch.slurm import read_launch_record, request_drain, submit_scripts, write_launch_record
from relax_hpc.roles import spec as roles
from relax_hpc.rundir import RunDir, proc_name


def _task_of(entry: dict[str, Any], rank: int) -> str | None:
    """The Slurm id of one elastic-role rank of a launch-record entry: its array task, or its het component."""
    names = list(entry.get("roles") or [entry.get("role")])
    elastic = [i for i, n in enumerate(names) if roles.is_elastic(n)]
    if not elastic:
        return None
    if len(names) == 1:
        return f"{entry['job_id']}_{rank}"
    return f"{entry['job_id']}+{elastic[0]}"


def rollout_workers(rec: dict[str, Any], q: slurm_cli.JobQuery) -> dict[int, dict[str, Any]]:
    """rank -> {"job_id": the task's id, "state", "active", "retired"} of every rollout rank ever launched."""
    retired = set(rec.get("retired", []))
    out: dict[int, dict[str, Any]] = {}
    for e in rec.get("jobs", []):
        for rank in e.get("ranks", []):
            task = _task_of(e, int(rank))
            if task is None:
                continue
            row = q.rows.get(task)
            out[int(rank)] = {"job_id": task, "state": row.state if row else "UNKNOWN",
                              "active": bool(row and row.active), "retired": int(rank) in retired,
                              "kind": e.get("kind"), "array": "+" not in task}
    return out


def _active(workers: dict[int, dict[str, Any]]) -> list[int]:
    return sorted(r for r, w in workers.items() if w["active"] and not w["retired"])


def scale_rollout(run_dir: RunDir | Path | str, target: int, *, wait: bool = True, timeout_s: float = 300.0,
                  python: str | None = None) -> dict[str, Any]:
    """Bring the number of running rollout workers of a Slurm ``fully_async`` run to ``target``."""
    if target < 0:
        raise UserError(f"--rollout must be >= 0, got {target}")
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir.open(run_dir)
    rec = read_launch_record(rd)
    if rec.get("executor") != "slurm":
        raise UserError(f"scale works for runs launched on Slurm; {rd.root} was launched with executor "
                        f"{rec.get('executor') or '(none)'}")
    mode = roles.MODES.get(str(rec.get("mode")))
    elastic = mode.elastic if mode is not None else None
    if elastic is None:
        ok = ", ".join(m.name for m in roles.MODES.values() if m.elastic)
        raise UserError(f"scale needs a mode whose workers can be added or drained ({ok}); this run's mode is "
                        f"{rec.get('mode') or '(none)'}")
    q = slurm_cli.query_jobs([e["job_id"] for e in rec.get("jobs", [])], use_sacct=False)
    workers = rollout_workers(rec, q)
    active = _active(workers)
    out: dict[str, Any] = {"before": len(active), "target": target, "added": [], "drained": [], "cancelled": [],
                           "jobs": [], "warnings": list(q.warnings)}
    if target > len(active):
        if rec.get("placement") != "separate":
            raise UserError("the rollout het group of a hetjob run is fixed at submission; adding workers needs "
                            "launch.placement: separate (resubmit with --set launch.placement=separate)")
        cfg = validate_resolved(read_json(rd.config))
        first = max(workers, default=-1) + 1
        ranks = list(range(first, first + target - len(active)))
        entries = submit_scripts(rd, [render_rollout_array(rd, cfg, ranks, python=python)])
        rec["jobs"] = [*rec.get("jobs", []), *entries]
        out["added"], out["jobs"] = ranks, [e["job_id"] for e in entries]
        write_launch_record(rd, rec)
    elif target < len(active):
        pending = [r for r in active if workers[r]["state"] == "PENDING"]
        running = [r for r in active if r not in pending]
        victims = (sorted(pending, reverse=True) + sorted(running, reverse=True))[:len(active) - target]
        cancel_now = [r for r in victims if r in pending]
        drain = [r for r in victims if r not in pending]
        for r in drain:
            request_drain(rd, proc_name(elastic.name, r))
        rec["retired"] = sorted(set(rec.get("retired", [])) | set(victims))
        write_launch_record(rd, rec)
        slurm_cli.scancel(workers[r]["job_id"] for r in cancel_now if workers[r]["array"])
        out["cancelled"] += cancel_now
        out["drained"] = drain
        if drain and wait:
            out["cancelled"] += _reap_drained(drain, workers, timeout_s, out["warnings"])
    out["after"] = target
    return out


def _reap_drained(drain: Sequence[int], workers: dict[int, dict[str, Any]], timeout_s: float,
                  warnings: list[str]) -> list[int]:
    """Wait for drained array tasks to end; cancel (by task id) those still running after ``timeout_s``."""
    tasks = {r: workers[r]["job_id"] for r in drain if workers[r]["array"]}
    if len(tasks) < len(drain):
        warnings.append("hetjob rollout workers were asked to drain; their het group keeps its allocation")
    end = time.monotonic() + timeout_s
    left = dict(tasks)
    while left and time.monotonic() < end:
        q = slurm_cli.query_jobs(left.values(), use_sacct=False)
        left = {r: t for r, t in left.items() if q.rows.get(t) is not None and q.rows[t].active}
        if left:
            time.sleep(0.5)
    if left:
        warnings.append(f"rollout ranks {sorted(left)} did not drain within {timeout_s:.0f}s: cancelled")
        slurm_cli.scancel(left.values())
    return sorted(left)
