"""``relax-hpc cancel RUN_DIR|SWEEP_DIR``: cancel exactly the jobs (scancel by id) or local processes (SIGTERM, then
SIGKILL after --timeout) recorded for this run or sweep. Roles checkpoint on SIGTERM: ``relax-hpc resume`` later."""

from __future__ import annotations

import argparse

from relax_hpc.cli.args import seconds


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run (or sweep) directory")
    p.add_argument("--timeout", type=seconds(allow_zero=True), default=30.0,
                   help="seconds to wait for the jobs/processes to end (local processes still alive then get "
                   "SIGKILL; default 30)")
    p.add_argument("--no-wait", action="store_true", help="return after sending the cancel")


def run(args: argparse.Namespace) -> int:
    from relax_hpc.launch.runctl import cancel_run
    from relax_hpc.rundir import RunDir, SweepDir

    if not RunDir(args.run_dir).is_run_dir() and SweepDir(args.run_dir).manifest.is_file():
        from relax_hpc.launch.sweep import cancel_sweep

        out = cancel_sweep(args.run_dir, timeout_s=args.timeout, wait=not args.no_wait)
    else:
        out = cancel_run(args.run_dir, timeout_s=args.timeout, wait=not args.no_wait)
    if out["cancelled_jobs"]:
        print(f"cancelled Slurm job(s) {' '.join(out['cancelled_jobs'])}")
    if out["signalled_pids"]:
        print(f"sent SIGTERM to pid(s) {' '.join(map(str, out['signalled_pids']))}")
    if out["killed_pids"]:
        print(f"sent SIGKILL to pid(s) {' '.join(map(str, out['killed_pids']))} (still alive after "
              f"{args.timeout:.0f}s)")
    if out["still_active"]:
        print(f"still ending: {' '.join(out['still_active'])}")
    if not (out["cancelled_jobs"] or out["signalled_pids"]):
        print("nothing to cancel: no job or process of this run is active")
    return 0
