"""``relax-hpc status RUN_DIR [--json]``: job states (one batched squeue + one sacct call) and role heartbeats.

Works for Slurm runs and for local runs (recorded pids, checked through /proc).
"""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("--json", action="store_true", help="print the status as JSON")


def run(args: argparse.Namespace) -> int:
    from relax_hpc.errors import UserError
    from relax_hpc.launch.runctl import format_status, run_status
    from relax_hpc.rundir import RunDir, SweepDir

    if not RunDir(args.run_dir).is_run_dir() and SweepDir(args.run_dir).manifest.is_file():
        raise UserError(f"{args.run_dir} is a sweep dir: use `relax-hpc sweep-status {args.run_dir}`")
    st = run_status(args.run_dir)
    print(json.dumps(st, indent=1, default=str) if args.json else format_status(st))
    return 0
