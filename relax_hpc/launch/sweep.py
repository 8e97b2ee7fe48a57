"""Hyper-parameter sweeps: a grid of ``--set`` overrides, one complete run dir per combination.

On Slurm the whole grid is ONE job array (one task per combination, ``%P`` at once); each task reads its run dir
from ``sweep.json`` by ``SLURM_ARRAY_TASK_ID`` and runs it as a colocate job. Locally each combination runs through
the local executor (``python -m relax_hpc submit RECIPE --executor local --run-dir ... --wait --set ...``), P at a
time as subprocesses. ``sweep_status`` reads each run's final metrics from its event log.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relax_hpc.config.load import config_to_json
from relax_hpc.config.schema import RecipeConfig
from relax_hpc.errors import ConfigError, UserError
from relax_hpc.fsio import atomic_write_json, atomic_write_text, read_json
from relax_hpc.launch import slurm_cli
from relax_hpc.launch.checks import load_checked
from relax_hpc.launch.sbatch import default_pythonpath, render_sweep, sweep_mode_problem
from relax_hpc.roles import spec as roles
from relax_hpc.rundir import RunDir, SweepDir, proc_name
from relax_hpc.trainer.checks import check_trainer


# ------------------------------------------------------------------------------------------------ the grid
def parse_grid(items: Sequence[str]) -> dict[str, list[str]]:
    """``["algorithm.lr=1e-6,3e-6", ...]`` -> ``{"algorithm.lr": ["1e-6", "3e-6"], ...}`` (order kept)."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--grid {item!r} is not of the form key.path=v1,v2,...")
        if key in grid:
            raise UserError(f"--grid {key} is given twice")
        if key.split(".")[0] == "launch":
            raise UserError(f"--grid {key}: launch settings are the same for every task of one job array")
        vals = [v.strip() for v in values.split(",")]
        if not all(vals):
            raise UserError(f"--grid {item!r} has an empty value")
        grid[key] = vals
    if not grid:
        raise UserError("a sweep needs at least one --grid key=v1,v2,...")
    return grid


def combinations(grid: dict[str, list[str]]) -> list[list[str]]:
    """Every combination of the grid as a list of ``key=value`` overrides (first key varies slowest)."""
    keys = list(grid)
    return [[f"{k}={v}" for k, v in zip(keys, values, strict=True)] for values in itertools.product(*grid.values())]


def label(overrides: Sequence[str]) -> str:
    """A short, filename-safe name of a combination: ``lr=1e-6,clip_high=0.2``."""
    parts = []
    for o in overrides:
        key, _, value = o.partition("=")
        parts.append(f"{key.split('.')[-1]}={value}")
    return re.sub(r"[^A-Za-z0-9._=,+-]+", "_", ",".join(parts))[:100]


def prepare(recipe: Path | str, grid_items: Sequence[str], sweep_dir: Path | str, *,
            overrides: Sequence[str] = (), executor: str, parallel: int) -> tuple[SweepDir, dict[str, Any],
                                                                                  list[RecipeConfig]]:
    """Validate every combination, then write ``sweep.json``. Nothing is written when one does not validate."""
    sd = SweepDir(sweep_dir)
    if sd.manifest.exists():
        raise UserError(f"{sd.root} already holds a sweep ({sd.manifest.name}); pick another --sweep-dir")
    if sd.root.exists() and (not sd.root.is_dir() or any(sd.root.iterdir())):
        raise UserError(f"{sd.root} exists and is not an empty folder")
    if parallel < 1:
        raise UserError(f"--parallel must be >= 1, got {parallel}")
    combos = combinations(parse_grid(grid_items))
    cfgs, runs = [], []
    for i, combo in enumerate(combos):
        try:
            cfgs.append(load_checked(recipe, [*overrides, *combo]))
            check_trainer(cfgs[-1])
        except UserError as exc:
            problems = exc.problems if isinstance(exc, ConfigError) else [str(exc)]
            raise UserError(f"combination {i} ({' '.join(combo)}): {'; '.join(problems)}") from None
        runs.append({"index": i, "label": label(combo), "overrides": combo,
                     "run_dir": str(sd.run(i, label(combo)))})
    problem = sweep_mode_problem(cfgs[0]) if executor == "slurm" else None
    if problem:
        raise UserError(problem)
    manifest = {"recipe": str(Path(recipe).absolute()), "overrides": list(overrides),
                "grid": parse_grid(grid_items), "executor": executor, "parallel": parallel,
                "created": time.time(), "runs": runs}
    try:
        for sub in (sd.root, sd.runs, sd.slurm, sd.logs):
            sub.mkdir(parents=True, exist_ok=True)
        atomic_write_json(sd.manifest, manifest)
    except OSError as exc:  # a read-only mount, no permission, a full disk: one line, not a traceback
        raise UserError(f"--sweep-dir: cannot write {sd.root}: {exc.strerror or exc}") from None
    return sd, manifest, cfgs


# ------------------------------------------------------------------------------------------------ Slurm
def submit_slurm(sd: SweepDir, manifest: dict[str, Any], cfgs: Sequence[RecipeConfig], *,
                 python: str | None = None) -> dict[str, Any]:
    """Create every run dir (recipe + resolved config), then submit ONE job array. Returns the sweep's record."""
    from relax_hpc.launch.slurm import require_slurm

    require_slurm()
    recipe_text = Path(manifest["recipe"]).read_text()
    for run, cfg in zip(manifest["runs"], cfgs, strict=True):
        rd = RunDir.create(run["run_dir"], name=cfg.name)
        sets = [*manifest["overrides"], *run["overrides"]]
        atomic_write_text(rd.recipe, recipe_text + "\n# overrides of this sweep combination:\n"
                          + "".join(f"#   --set {o}\n" for o in sets))
        atomic_write_json(rd.config, config_to_json(cfg))
    script = render_sweep(sd, cfgs[0], len(cfgs), parallel=manifest["parallel"], python=python)
    atomic_write_text(sd.slurm_script, script.text)
    sd.slurm_script.chmod(0o755)
    array_id = slurm_cli.sbatch(sd.slurm_script)
    role = roles.mode_spec(cfgs[0]).main.name
    for run in manifest["runs"]:
        rd = RunDir(run["run_dir"])
        atomic_write_json(rd.launch_record, {
            "executor": "slurm", "mode": cfgs[0].mode, "placement": None, "sweep": str(sd.root),
            "submitted": time.time(), "retired": [], "history": [],
            "jobs": [{"job_id": f"{array_id}_{run['index']}", "kind": "sweep_task", "role": role,
                      "roles": [role], "ranks": [], "script": str(sd.slurm_script)}]})
    record = {"executor": "slurm", "array_job_id": array_id, "parallel": manifest["parallel"],
              "num_runs": len(cfgs), "submitted": time.time()}
    atomic_write_json(sd.launch_record, record)
    return record


# ------------------------------------------------------------------------------------------------ local
def run_local(sd: SweepDir, manifest: dict[str, Any], *, timeout_s: float = 86_400.0, poll_s: float = 0.5,
              echo: Any = print) -> dict[str, Any]:
    """Run every combination through the local executor, ``parallel`` at a time. Returns index -> exit code.

    Each combination is ``python -m relax_hpc submit RECIPE --executor local --run-dir RUN --wait --set ...``, its
    output in ``SWEEP_DIR/logs/NNN.log``. On timeout or Ctrl-C the started submits get SIGTERM (they stop their
    roles, which checkpoint).
    """
    env = dict(os.environ)
    src = default_pythonpath()
    if src:
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    todo = list(manifest["runs"])
    running: dict[int, subprocess.Popen[bytes]] = {}
    codes: dict[int, int] = {}
    record: dict[str, Any] = {"executor": "local", "parallel": manifest["parallel"], "submitted": time.time(),
                              "procs": [], "exit_codes": codes}
    end = time.monotonic() + timeout_s
    try:
        while todo or running:
            while todo and len(running) < manifest["parallel"]:
                run = todo.pop(0)
                argv = [sys.executable, "-m", "relax_hpc", "submit", manifest["recipe"], "--executor", "local",
                        "--run-dir", run["run_dir"], "--wait"]
                for o in [*manifest["overrides"], *run["overrides"]]:
                    argv += ["--set", o]
                with open(sd.local_log(run["index"]), "ab") as log:
                    p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env)
                running[run["index"]] = p
                record["procs"].append({"index": run["index"], "pid": p.pid, "run_dir": run["run_dir"]})
                atomic_write_json(sd.launch_record, record)
                echo(f"started combination {run['index']} ({run['label']}): pid {p.pid}")
            for i, p in list(running.items()):
                if p.poll() is not None:
                    codes[i] = p.returncode
                    del running[i]
                    atomic_write_json(sd.launch_record, record)
                    echo(f"combination {i} ended with exit code {p.returncode}")
            if time.monotonic() > end:
                raise TimeoutError
            time.sleep(poll_s)
    except (KeyboardInterrupt, TimeoutError) as exc:
        for p in running.values():
            p.terminate()
        for i, p in running.items():
            try:
                codes[i] = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[i] = p.wait(timeout=10)
        atomic_write_json(sd.launch_record, record)
        if isinstance(exc, TimeoutError):
            raise UserError(f"the sweep did not finish within {timeout_s:.0f}s; stopped its runs") from None
        raise
    atomic_write_json(sd.launch_record, record)
    return codes


# ------------------------------------------------------------------------------------------------ results
def _last_metrics(path: Path, max_bytes: int = 1 << 20) -> dict[str, Any] | None:
    """The last ``metrics`` record of an event log (preferring one with ``rollout/reward``), read from its end."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    fallback = None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") != "metrics" or not isinstance(rec.get("metrics"), dict):
            continue
        if "rollout/reward" in rec["metrics"]:
            return rec
        fallback = fallback or rec
    return fallback


def check_manifest(manifest: dict[str, Any], sd: SweepDir) -> None:
    """A sweep.json whose ``runs`` are not entries with an integer ``index`` and a ``run_dir`` is damaged."""
    runs, grid = manifest.get("runs"), manifest.get("grid") or {}
    ok = isinstance(runs, list) and isinstance(grid, dict) and all(
        isinstance(r, dict) and isinstance(r.get("index"), int) and isinstance(r.get("run_dir"), str)
        and isinstance(r.get("overrides"), list) and len(r["overrides"]) == len(grid)
        and all(isinstance(o, str) for o in r["overrides"]) for r in runs)
    if not ok:
        raise UserError(f"cannot read {sd.manifest}: damaged (`runs` must list objects with an index, a run_dir "
                        "and one override per grid key)")


def sweep_status(sweep_dir: SweepDir | Path | str) -> dict[str, Any]:
    """Per combination: overrides, state, last step and final metrics (plus the array task's Slurm state)."""
    sd = sweep_dir if isinstance(sweep_dir, SweepDir) else SweepDir(sweep_dir)
    manifest = read_json(sd.manifest, default=None, expect=(dict, type(None)))
    if manifest is None:
        raise UserError(f"{sd.root} is not a sweep dir (no {sd.manifest.name})")
    check_manifest(manifest, sd)
    record = read_json(sd.launch_record, default={}, expect=dict) or {}
    tasks: dict[str, slurm_cli.JobState] = {}
    warnings: list[str] = []
    if record.get("executor") == "slurm" and record.get("array_job_id"):
        try:
            q = slurm_cli.query_jobs([record["array_job_id"]])
            tasks, warnings = q.rows, q.warnings
        except UserError as exc:
            warnings.append(str(exc))
    codes = {int(k): v for k, v in (record.get("exit_codes") or {}).items()}
    rows = []
    for run in manifest["runs"]:
        rd = RunDir(run["run_dir"])
        final = read_json(rd.status_file, default=None, expect=dict) if rd.root.is_dir() else None
        rec = None
        for role in roles.trainer_side_names():
            rec = _last_metrics(rd.event_log(proc_name(role, 0)))
            if rec:
                break
        task = tasks.get(f"{record.get('array_job_id')}_{run['index']}")
        if isinstance(final, dict) and final.get("state"):
            state = str(final["state"])
        elif task is not None:
            state = task.state.split()[0].lower()
        elif run["index"] in codes:
            state = "completed" if codes[run["index"]] == 0 else f"exit {codes[run['index']]}"
        else:
            state = "running" if rec else "pending"
        rows.append({"index": run["index"], "label": run["label"], "overrides": run["overrides"],
                     "run_dir": run["run_dir"], "state": state, "step": rec.get("step") if rec else None,
                     "metrics": rec.get("metrics", {}) if rec else {},
                     "slurm": task.state if task is not None else None})
    return {"sweep_dir": str(sd.root), "executor": record.get("executor"), "grid": manifest.get("grid"),
            "runs": rows, "warnings": warnings}


def format_sweep_status(st: dict[str, Any], metrics: Sequence[str] = ("rollout/reward",)) -> str:
    """A plain table: one line per combination, its overrides, state, step and the chosen metrics."""
    keys = list(st.get("grid") or {})
    head = [k.split(".")[-1] for k in keys] + ["state", "step", *metrics]
    table = []
    for r in st["runs"]:
        values = [o.partition("=")[2] for o in r["overrides"]]
        cells = [*values, r["state"], "-" if r["step"] is None else str(r["step"])]
        for m in metrics:
            v = r["metrics"].get(m)
            cells.append(f"{v:.4g}" if isinstance(v, (int, float)) else "-" if v is None else str(v))
        table.append(cells)
    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(["#", *head], [3, *widths], strict=True))]
    for r, cells in zip(st["runs"], table, strict=True):
        lines.append("  ".join(c.ljust(w) for c, w in zip([str(r["index"]), *cells], [3, *widths], strict=True)))
    lines += [f"warning: {w}" for w in st["warnings"]]
    return "\n".join(lines)


def cancel_sweep(sweep_dir: SweepDir | Path | str, *, timeout_s: float = 30.0, wait: bool = True
                 ) -> dict[str, Any]:
    """Cancel a sweep: its job array (by id) on Slurm, or its recorded local submit processes (SIGTERM)."""
    from relax_hpc.launch.runctl import proc_alive

    sd = sweep_dir if isinstance(sweep_dir, SweepDir) else SweepDir(sweep_dir)
    record = read_json(sd.launch_record, default={}, expect=dict) or {}
    out: dict[str, Any] = {"cancelled_jobs": [], "signalled_pids": [], "killed_pids": [], "still_active": []}
    if record.get("executor") == "slurm" and record.get("array_job_id"):
        aid = str(record["array_job_id"])
        q = slurm_cli.query_jobs([aid], use_sacct=False)
        if any(r.active for r in q.of(aid)):
            slurm_cli.scancel([aid])
            out["cancelled_jobs"].append(aid)
        if wait and out["cancelled_jobs"]:
            end = time.monotonic() + timeout_s
            while time.monotonic() < end and any(
                    r.active for r in slurm_cli.query_jobs([aid], use_sacct=False).of(aid)):
                time.sleep(0.25)
    if record.get("executor") == "local":  # the roles first (they checkpoint), then the submits following them
        from relax_hpc.launch.runctl import cancel_run

        for p in record.get("procs", []):
            rd = RunDir(p["run_dir"])
            if rd.is_run_dir() and rd.launch_record.is_file():
                sub = cancel_run(rd, timeout_s=timeout_s, wait=wait)
                for key in ("signalled_pids", "killed_pids"):
                    out[key] += sub[key]
    for p in record.get("procs", []):
        if proc_alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(p["pid"]), signal.SIGTERM)
                out["signalled_pids"].append(int(p["pid"]))
    return out
