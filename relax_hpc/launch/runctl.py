"""State and cancellation of a launched run, Slurm or local, read from its ``launch.json`` and heartbeats.

Status costs ONE ``squeue`` and ONE ``sacct`` call however many jobs the run has; local runs are checked through
``/proc``. Cancel touches only the job ids and pids recorded for this run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from relax_hpc.errors import UserError
from relax_hpc.events import read_heartbeats
from relax_hpc.fsio import atomic_write_json, read_json
from relax_hpc.launch import slurm_cli
from relax_hpc.roles import spec as roles
from relax_hpc.rundir import RunDir

DEFAULT_DEAD_AFTER_S = 120.0


# ------------------------------------------------------------------------------------------------ local processes
def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a live pid, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return fields[0], int(fields[19])


def on_this_host(entry: dict[str, Any]) -> bool:
    """Was the recorded process started on this machine? (Entries without a host are taken as local.)"""
    host = entry.get("host")
    return not host or host in (os.uname().nodename, socket.gethostname())


def proc_alive(entry: dict[str, Any]) -> bool:
    """Is the recorded local process still the one we started? (pid alive, not a zombie, and, to survive pid reuse,
    the same start time when recorded, or a command line that runs relax_hpc)."""
    try:
        pid = int(entry["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    if not on_this_host(entry):
        return False
    st = _proc_stat(pid)
    if st is None or st[0] in ("Z", "X"):
        return False
    if entry.get("starttime") is not None:
        return int(entry["starttime"]) == st[1]
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"relax_hpc" in cmdline or b"relax-hpc" in cmdline


def _proc_label(entry: dict[str, Any]) -> str:
    if entry.get("proc"):
        return str(entry["proc"])
    if entry.get("role") is not None:
        return f"{entry['role']}-{entry.get('rank', 0)}"
    return str(entry.get("name", entry.get("pid")))


# ------------------------------------------------------------------------------------------------ status
def open_run(run_dir: RunDir | Path | str) -> RunDir:
    return run_dir if isinstance(run_dir, RunDir) else RunDir.open(run_dir)


def run_status(run_dir: RunDir | Path | str) -> dict[str, Any]:
    """Everything ``relax-hpc status`` shows: jobs (or local processes), role heartbeats, the final state."""
    rd = open_run(run_dir)
    rec = read_json(rd.launch_record, default={}, expect=dict) or {}
    cfg = read_json(rd.config, default={}, expect=dict) or {}
    dead_after = float((cfg.get("monitor") or {}).get("dead_after_s", DEFAULT_DEAD_AFTER_S))
    retired = set(rec.get("retired", []))
    out: dict[str, Any] = {"run_dir": str(rd.root), "run_id": rd.info().get("run_id"),
                           "executor": rec.get("executor"), "mode": rec.get("mode") or cfg.get("mode"),
                           "placement": rec.get("placement"),
                           "final": read_json(rd.status_file, default=None, expect=dict),
                           "jobs": [], "procs": [], "roles": [], "warnings": []}
    any_active = False
    if rec.get("executor") == "slurm" and rec.get("jobs"):
        q = slurm_cli.query_jobs(e["job_id"] for e in rec["jobs"])
        out["warnings"] += q.warnings
        for e in rec["jobs"]:
            rows = q.of(e["job_id"])
            active = any(r.active for r in rows)
            any_active |= active
            out["jobs"].append({"job_id": e["job_id"], "kind": e.get("kind"), "role": e.get("role"),
                                "ranks": e.get("ranks", []), "active": active,
                                "states": [{"id": r.job_id, "state": r.state, "reason": r.reason,
                                            "exit_code": r.exit_code, "elapsed": r.elapsed, "nodes": r.nodes}
                                           for r in rows]})
    for p in rec.get("procs", []) or []:
        if not on_this_host(p):
            out["warnings"].append(f"{_proc_label(p)} runs on {p.get('host')}: run status there to see it")
            out["procs"].append({"proc": _proc_label(p), "pid": p.get("pid"), "alive": None})
            continue
        alive = proc_alive(p)
        any_active |= alive
        out["procs"].append({"proc": _proc_label(p), "pid": p.get("pid"), "alive": alive})
    out["restarts"] = restarts = read_restarts(rd)
    out["group_restarts"] = read_group_restarts(rd)
    for proc, hb in sorted(read_heartbeats(rd).items()):
        state = hb.get("state")
        out["roles"].append({"proc": proc, "role": hb.get("role"), "rank": hb.get("rank"), "state": state,
                             "restarts": restarts.get(proc, {}).get("restarts", 0),
                             "step": hb.get("step"), "version": hb.get("version"), "age_s": round(hb["age_s"], 1),
                             "host": hb.get("host"), "pid": hb.get("pid"), "slurm_job_id": hb.get("slurm_job_id"),
                             "live": state not in ("stopped", "failed") and hb["age_s"] <= dead_after,
                             "retired": roles.is_elastic(hb.get("role")) and hb.get("rank") in retired})
    final = out["final"] if isinstance(out["final"], dict) else None
    if final and final.get("state"):
        out["state"] = str(final["state"])
    elif any_active:
        out["state"] = "running"
    elif rec:
        out["state"] = "stopped"
    else:
        out["state"] = "not launched"
    out["active"] = any_active
    return out


def read_restarts(rd: RunDir) -> dict[str, dict[str, Any]]:
    """The role supervisor's restart records (``supervisor/<proc>.json``): proc -> {restarts, last reason, gave up}.
    An unreadable record is reported as such, not skipped."""
    out: dict[str, dict[str, Any]] = {}
    try:
        files = sorted(rd.supervisor.glob("*.json"))
    except OSError:
        return out
    for path in files:
        if path.name.startswith("."):
            continue
        try:
            rec = read_json(path, expect=dict)
        except (OSError, ValueError) as exc:
            out[path.stem] = {"restarts": 0, "problem": str(exc)[:200]}
            continue
        history = [h for h in rec.get("history") or [] if isinstance(h, dict)]
        n = rec.get("restarts")
        out[path.stem] = {"restarts": n if isinstance(n, int) else 0,
                          "last_reason": history[-1].get("reason") if history else None,
                          "gave_up": rec.get("gave_up")}
    return out


def read_group_restarts(rd: RunDir) -> dict[str, dict[str, Any]]:
    """Process groups restarted as a whole (``supervisor/groups/<group>.json``): group -> {generation, by, reason}.
    An unreadable record is reported as such."""
    out: dict[str, dict[str, Any]] = {}
    for group in sorted({r.group for r in roles.ROLES.values() if r.group}):
        path = rd.group_restart_file(group)
        try:
            rec = read_json(path, default=None, expect=dict)
        except (OSError, ValueError) as exc:
            out[group] = {"generation": 0, "problem": str(exc)[:200]}
            continue
        if rec:
            out[group] = {k: rec.get(k) for k in ("generation", "by", "reason")}
    return out


def format_status(st: dict[str, Any]) -> str:
    """The human-readable table of :func:`run_status`."""
    lines = [f"run {st['run_id']}  {st['run_dir']}",
             f"state: {st['state']}   executor: {st['executor'] or '-'}   mode: {st['mode'] or '-'}"
             + (f"   placement: {st['placement']}" if st.get("placement") else "")]
    if st["jobs"]:
        lines += ["", f"{'JOB':<14} {'KIND':<14} {'STATE':<12} {'ELAPSED':>10}  {'EXIT':<6} NODES / REASON"]
        for j in st["jobs"]:
            for r in j["states"]:
                where = r["nodes"] if r["state"] == "RUNNING" else (r["reason"] or r["nodes"])
                lines.append(f"{r['id']:<14} {j['kind'] or '-':<14} {r['state']:<12} {r['elapsed'] or '-':>10}  "
                             f"{r['exit_code'] or '-':<6} {where or ''}".rstrip())
    if st["procs"]:
        lines += ["", f"{'PROCESS':<16} {'PID':>8}  ALIVE"]
        yes_no = {True: "yes", False: "no", None: "unknown (another host)"}
        lines += [f"{p['proc']:<16} {p['pid']!s:>8}  {yes_no[p['alive']]}" for p in st["procs"]]
    if st["roles"]:
        lines += ["", f"{'ROLE':<14} {'STATE':<10} {'STEP':>6} {'VERSION':>8} {'AGE':>8} {'RESTARTS':>8}  "
                  f"{'HOST':<12} SLURM JOB"]
        for r in st["roles"]:
            flag = "" if r["live"] or r["state"] in ("stopped", "failed") else "  (no heartbeat: dead?)"
            flag += "  (retired)" if r["retired"] else ""
            lines.append(f"{r['proc']:<14} {r['state'] or '-':<10} {r['step'] if r['step'] is not None else '-':>6} "
                         f"{r['version'] if r['version'] is not None else '-':>8} {r['age_s']:>7.0f}s "
                         f"{r.get('restarts', 0):>8}  {r['host'] or '-':<12} {r['slurm_job_id'] or '-'}{flag}")
    restarted = {p: r for p, r in (st.get("restarts") or {}).items() if r.get("restarts") or r.get("problem")}
    if restarted:
        lines += ["", f"restarts by the role supervisor: {sum(r['restarts'] for r in restarted.values())}"]
        for p, r in restarted.items():
            why = r.get("problem") or f"last: {r.get('last_reason') or '-'}"
            lines.append(f"  {p:<14} {r['restarts']:>4}  {why}" + ("  (gave up: max_restarts)" if r.get("gave_up")
                                                                     else ""))
    for g, r in (st.get("group_restarts") or {}).items():
        why = r.get("problem") or f"last: {r.get('by') or '-'} {r.get('reason') or ''}".rstrip()
        lines.append(f"  process group {g}: every rank restarted {r.get('generation')} time(s); {why}")
    for w in st["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ cancel
def _wait_until(predicate: Any, timeout_s: float, poll_s: float = 0.25) -> bool:
    end = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(poll_s)


def cancel_run(run_dir: RunDir | Path | str, *, timeout_s: float = 30.0, wait: bool = True) -> dict[str, Any]:
    """Cancel a run: ``scancel`` its recorded Slurm job ids, or SIGTERM its recorded local pids (SIGKILL after
    ``timeout_s``). Roles checkpoint on SIGTERM, so ``relax-hpc resume`` can continue later."""
    rd = open_run(run_dir)
    rec = read_json(rd.launch_record, default={}, expect=dict) or {}
    if not rec:
        raise UserError(f"{rd.root} has no {rd.launch_record.name}: nothing was launched there")
    out: dict[str, Any] = {"cancelled_jobs": [], "signalled_pids": [], "killed_pids": [], "still_active": []}
    if rec.get("executor") == "slurm":
        ids = [e["job_id"] for e in rec.get("jobs", [])]
        q = slurm_cli.query_jobs(ids, use_sacct=False)
        active = [j for j in ids if any(r.active for r in q.of(j))]
        slurm_cli.scancel(active)
        out["cancelled_jobs"] = active
        if wait and active:
            def gone() -> bool:
                qq = slurm_cli.query_jobs(active, use_sacct=False)
                return not any(r.active for j in active for r in qq.of(j))
            if not _wait_until(gone, timeout_s):
                qq = slurm_cli.query_jobs(active, use_sacct=False)
                out["still_active"] = [r.job_id for j in active for r in qq.of(j) if r.active]
    elsewhere = [p for p in rec.get("procs", []) or [] if not on_this_host(p)]
    if elsewhere:
        raise UserError(f"{_proc_label(elsewhere[0])} runs on {elsewhere[0].get('host')}: run cancel there")
    procs = [p for p in rec.get("procs", []) or [] if proc_alive(p)]
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(p["pid"]), signal.SIGTERM)
            out["signalled_pids"].append(int(p["pid"]))
    if procs and wait and not _wait_until(lambda: not any(proc_alive(p) for p in procs), timeout_s):
        for p in procs:
            if proc_alive(p):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(p["pid"]), signal.SIGKILL)
                    out["killed_pids"].append(int(p["pid"]))
    rec["cancelled"] = time.time()
    atomic_write_json(rd.launch_record, rec)
    ended = not out["still_active"] and not any(proc_alive(p) for p in procs)
    if wait and ended and (out["cancelled_jobs"] or out["signalled_pids"]) and not rd.status_file.exists():
        # the roles checkpointed on SIGTERM: resumable, not failed (a launcher still following writes the same)
        atomic_write_json(rd.status_file, {"state": "interrupted", "by": "cancel", "time": time.time()})
    return out
