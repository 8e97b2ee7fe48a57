"""Sweeps: a folder whose subfolders are run dirs, and/or a ``sweep.json`` listing them.

``sweep.json`` is read leniently: a list of entries, or an object with a ``runs`` list; an entry is a path
(relative to the sweep folder) or an object with ``run_dir`` (or ``path``) and optional ``label`` (or ``name``) and
``overrides`` (or ``params``), as ``relax-hpc sweep`` writes it. Runs listed there that do not exist yet show as
``pending``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_hpc.errors import RunDirError
from relax_hpc.fsio import read_json
from relax_hpc.monitor.slurm import SlurmPoller
from relax_hpc.monitor.state import RunMonitor
from relax_hpc.rundir import RunDir

SWEEP_FILE = "sweep.json"


@dataclass
class SweepEntry:
    """One run of a sweep."""

    label: str
    path: Path
    params: Any = field(default=None)
    """The combination's overrides, as sweep.json gives them (dict or list), if any."""


def _entries_from_file(folder: Path) -> list[SweepEntry]:
    try:
        data = read_json(folder / SWEEP_FILE, default=None)
    except OSError as exc:
        raise RunDirError(f"cannot read {folder / SWEEP_FILE}: {exc.strerror or exc}") from exc
    items = data.get("runs", []) if isinstance(data, dict) else data if isinstance(data, list) else []
    if not isinstance(items, list):
        raise RunDirError(f"cannot read {folder / SWEEP_FILE}: damaged (`runs` is not a list)")
    out = []
    for item in items:
        path: Any
        if isinstance(item, str):
            path, label, params = item, None, None
        elif isinstance(item, dict):
            path = item.get("run_dir") or item.get("path") or item.get("dir")
            label, params = item.get("label") or item.get("name"), item.get("overrides", item.get("params"))
        else:
            continue
        if not isinstance(path, str) or not path:
            continue
        p = Path(path) if Path(path).is_absolute() else folder / path
        out.append(SweepEntry(label=str(label or p.name), path=p, params=params))
    return out


def find_runs(folder: Path | str) -> list[SweepEntry]:
    """The runs of a sweep folder: sweep.json's entries first, then run-dir subfolders it does not list."""
    folder = Path(folder).expanduser().absolute()
    entries = _entries_from_file(folder) if (folder / SWEEP_FILE).is_file() else []
    listed = {e.path.resolve() for e in entries}
    try:
        subdirs = sorted(p for p in folder.iterdir() if p.is_dir())
    except OSError:
        subdirs = []
    for sub in subdirs:
        if RunDir(sub).is_run_dir() and sub.resolve() not in listed:
            entries.append(SweepEntry(label=sub.name, path=sub))
    return entries


def is_sweep(folder: Path | str) -> bool:
    """True if ``folder`` holds a sweep.json or at least one run-dir subfolder (and is not itself a run dir)."""
    folder = Path(folder).expanduser()
    if RunDir(folder).is_run_dir() or not folder.is_dir():
        return False
    return (folder / SWEEP_FILE).is_file() or bool(find_runs(folder))


class SweepMonitor:
    """Follows every run of a sweep; one batched ``squeue`` call per refresh for all of them."""

    def __init__(self, folder: Path | str, *, slurm: SlurmPoller | None = None):
        self.folder = Path(folder).expanduser().absolute()
        self.slurm = slurm if slurm is not None else SlurmPoller()
        self.runs: dict[Path, RunMonitor] = {}

    def refresh(self) -> dict[str, Any]:
        """``{"sweep": folder, "runs": [snapshot + label + params, ...]}``; runs not started yet are ``pending``."""
        entries = find_runs(self.folder)
        for e in entries:
            if e.path not in self.runs and RunDir(e.path).is_run_dir():
                try:
                    self.runs[e.path] = RunMonitor(e.path, slurm=self.slurm)
                except RunDirError:
                    continue
        for run in self.runs.values():
            run.update()
        states = self.slurm.states([j for m in self.runs.values() for j in m.job_ids()])
        rows = []
        for e in entries:
            mon = self.runs.get(e.path)
            snap = mon.snapshot(states) if mon else {"run_dir": str(e.path), "state": "pending", "roles": {},
                                                     "step": None, "total_steps": None, "reward_mean": None}
            snap["label"], snap["params"] = e.label, e.params
            rows.append(snap)
        return {"sweep": str(self.folder), "runs": rows}
