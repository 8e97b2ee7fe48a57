"""The monitor's loop: open a run or a sweep, refresh, fire alerts, draw (live) or print once (text or JSON)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from relax_hpc.errors import RunDirError
from relax_hpc.monitor.alerts import AlertWatcher
from relax_hpc.monitor.state import RunMonitor, json_safe
from relax_hpc.monitor.sweep import SweepMonitor, is_sweep
from relax_hpc.rundir import RunDir


def open_target(path: Path | str) -> RunMonitor | SweepMonitor:
    """A :class:`RunMonitor` for a run dir, a :class:`SweepMonitor` for a sweep dir; :class:`RunDirError` else."""
    p = Path(path).expanduser()
    if RunDir(p).is_run_dir():
        return RunMonitor(p)
    if not p.exists():
        raise RunDirError(f"{p} does not exist")
    if is_sweep(p):
        return SweepMonitor(p)
    raise RunDirError(f"{p} is not a relax-hpc run dir (no RUN.json) nor a sweep dir (no sweep.json, no run dirs "
                      "inside)")


class Monitor:
    """A run or sweep target plus its alert watchers (one per run)."""

    def __init__(self, target: RunMonitor | SweepMonitor, *, alerts: bool = True):
        self.target = target
        self.alerts = alerts
        self._watchers: dict[str, AlertWatcher] = {}

    @property
    def is_sweep(self) -> bool:
        return isinstance(self.target, SweepMonitor)

    def refresh(self) -> dict[str, Any]:
        """Read what changed; fire alerts for each run (when enabled). Returns the run or sweep snapshot."""
        snap = self.target.refresh()
        if self.alerts:
            for run in snap["runs"] if self.is_sweep else [snap]:
                if "run_id" not in run:
                    continue  # a sweep run that has not started
                w = self._watchers.get(run["run_dir"])
                if w is None:
                    w = self._watchers[run["run_dir"]] = AlertWatcher(run["run_dir"])
                w.check(run)
        return snap

    def render(self, snap: dict[str, Any], *, height: int = 50) -> Any:
        from relax_hpc.monitor.view import run_view, sweep_view

        if self.is_sweep:
            return sweep_view(snap)
        return run_view(snap, max_role_rows=max(4, height - 22))

    def close(self) -> None:
        for w in self._watchers.values():
            w.close()


def to_json(snap: dict[str, Any]) -> str:
    """A snapshot as JSON (non-finite numbers as strings, like the event logs)."""
    return json.dumps(json_safe(snap), indent=1, default=str)


def watch(monitor: Monitor, *, interval_s: float, duration_s: float | None = None, console: Any = None) -> int:
    """Redraw every ``interval_s`` until Ctrl-C or ``duration_s``. Returns the number of refreshes done."""
    from rich.console import Console
    from rich.live import Live

    console = console if console is not None else Console()
    start = time.monotonic()
    refreshes = 0
    snap = monitor.refresh()
    refreshes += 1
    with Live(monitor.render(snap, height=console.size.height), console=console, auto_refresh=False,
              screen=False, redirect_stdout=False, redirect_stderr=False) as live:
        try:
            while True:
                next_at = start + refreshes * interval_s
                if duration_s is not None and (next_at - start > duration_s
                                               or time.monotonic() - start >= duration_s):
                    break  # wall-clock: a slow refresh does not stretch the duration
                time.sleep(max(0.0, next_at - time.monotonic()))
                snap = monitor.refresh()
                refreshes += 1
                live.update(monitor.render(snap, height=console.size.height), refresh=True)
        except KeyboardInterrupt:
            pass
    return refreshes
