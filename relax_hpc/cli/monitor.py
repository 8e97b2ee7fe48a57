"""``relax-hpc monitor RUN_DIR``: live view of a run (or a sweep), read only from the run dir.

Works from a login node while the job runs, after it ended, and for a whole sweep folder. ``--once`` prints one
snapshot, ``--json`` prints it as JSON (keys documented in docs/monitor.md). Alerts (dead role, NaN loss, stall)
fire from the live view unless ``--no-alerts``; ``--once``/``--json`` never fire alerts.
"""

from __future__ import annotations

import argparse

from relax_hpc.cli.args import seconds
from relax_hpc.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run dir, or a sweep dir (sub-folders that are run dirs and/or sweep.json)")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit (implies --once)")
    p.add_argument("--interval", type=seconds(), default=2.0, metavar="S", help="refresh period in seconds (default 2)")
    p.add_argument("--duration", type=seconds(), default=None, metavar="S",
                   help="stop the live view after S seconds (default: until Ctrl-C)")
    p.add_argument("--no-alerts", action="store_true", help="do not fire alerts from the live view")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from relax_hpc.monitor.live import Monitor, open_target, to_json, watch

    if args.interval <= 0:
        raise UserError(f"--interval must be positive (got {args.interval})")
    once = args.once or args.json
    monitor = Monitor(open_target(args.run_dir), alerts=not (once or args.no_alerts))
    try:
        if args.json:
            print(to_json(monitor.refresh()))
        elif once:
            console = Console()
            console.print(monitor.render(monitor.refresh(), height=10_000))
        else:
            watch(monitor, interval_s=args.interval, duration_s=args.duration)
    finally:
        monitor.close()
    return 0
