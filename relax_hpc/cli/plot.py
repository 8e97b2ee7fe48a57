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


def check_output(name: str) -> Path:
    """The output file, checked before anything is read: a name, a format matplotlib writes, a writable folder."""
    from relax_hpc.fsio import check_writable

    if not name.strip():
        raise UserError("-o/--output: the output file name is empty")
    out = Path(name).expanduser()
    if name.endswith("/") or out.is_dir():
        raise UserError(f"-o/--output: {out} is a folder; give a file name such as {out / 'curves.png'}")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = out.suffix.lower().lstrip(".")
    if suffix not in formats:
        raise UserError(f"-o/--output: {out.name!r} has no supported image suffix; use one of "
                        f"{', '.join(sorted(formats))}")
    if not out.parent.is_dir():
        raise UserError(f"cannot write {out}: folder {out.parent} does not exist")
    check_writable(out.parent, f"-o/--output {out}:")
    return out


def run(args: argparse.Namespace) -> int:
    from relax_hpc.monitor.live import open_target
    from relax_hpc.monitor.plot import load_history, plot_histories
    from relax_hpc.monitor.state import RunMonitor
    from relax_hpc.monitor.sweep import find_runs
    from relax_hpc.rundir import RunDir

    check_output(args.output)
    target = open_target(args.run_dir)
    if isinstance(target, RunMonitor):
        histories = [load_history(target.rd)]
    else:
        histories = [load_history(e.path, label=e.label) for e in find_runs(target.folder)
                     if RunDir(e.path).is_run_dir()]
        if not histories:
            raise UserError(f"no run of the sweep {target.folder} has started yet; nothing to plot")
    out = check_output(args.output)
    try:
        plot_histories(histories, out, title=args.title, smooth=not args.no_smooth)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {exc.strerror or exc}") from None
    steps = max(h.num_steps for h in histories)
    print(f"wrote {out} ({len(histories)} run{'s' if len(histories) > 1 else ''}, up to {steps} steps)")
    return 0
