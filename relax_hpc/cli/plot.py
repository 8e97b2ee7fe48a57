"""``relax-hpc plot RUN_DIR -o curves.png``: a run's (or a sweep's, one line per run) training curves."""

from __future__ import annotations

import argparse
from pathlib import Path

from relax_hpc.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run dir, or a sweep dir (sub-folders that are run dirs and/or sweep.json)")
    p.add_argument("-o", "--output", default="curves.png", help="PNG file to write (default curves.png)")
    p.add_argument("--title", default=None, help="figure title (default: the run's name / the number of runs)")
    p.add_argument("--no-smooth", action="store_true", help="draw raw curves only (no moving average)")


def run(args: argparse.Namespace) -> int:
    from relax_hpc.monitor.live import open_target
    from relax_hpc.monitor.plot import load_history, plot_histories
    from relax_hpc.monitor.state import RunMonitor
    from relax_hpc.monitor.sweep import find_runs
    from relax_hpc.rundir import RunDir

    target = open_target(args.run_dir)
    if isinstance(target, RunMonitor):
        histories = [load_history(target.rd)]
    else:
        histories = [load_history(e.path, label=e.label) for e in find_runs(target.folder)
                     if RunDir(e.path).is_run_dir()]
        if not histories:
            raise UserError(f"no run of the sweep {target.folder} has started yet; nothing to plot")
    out = Path(args.output).expanduser()
    if not out.parent.is_dir():
        raise UserError(f"cannot write {out}: folder {out.parent} does not exist")
    plot_histories(histories, out, title=args.title, smooth=not args.no_smooth)
    steps = max(h.num_steps for h in histories)
    print(f"wrote {out} ({len(histories)} run{'s' if len(histories) > 1 else ''}, up to {steps} steps)")
    return 0
