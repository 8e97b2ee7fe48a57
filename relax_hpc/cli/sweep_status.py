"""``relax-hpc sweep-status SWEEP_DIR [--json] [--metric NAME ...]``: a table of final metrics per combination, read
from each run's event log (the trainer's last metrics record), with the array task's Slurm state."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep_dir", help="the sweep directory")
    p.add_argument("--json", action="store_true", help="print every run's state and final metrics as JSON")
    p.add_argument("--metric", action="append", default=None, metavar="NAME",
                   help="metric column(s) of the table (default: rollout/reward)")


def run(args: argparse.Namespace) -> int:
    from relax_hpc.launch.sweep import format_sweep_status, sweep_status

    st = sweep_status(args.sweep_dir)
    if args.json:
        print(json.dumps(st, indent=1, default=str))
    else:
        print(format_sweep_status(st, args.metric or ["rollout/reward"]))
    return 0
