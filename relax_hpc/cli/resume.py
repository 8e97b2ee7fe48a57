"""``relax-hpc resume RUN_DIR``: resubmit a stopped run into the same run dir; the trainer resumes from its latest
checkpoint and the rollout workers rejoin at the latest weights."""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("--executor", choices=("auto", "local", "slurm"), default=None,
                   help="where to run (default: where the run ran before)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch scripts; submit nothing")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--wait", action="store_true", help="follow a Slurm run until it ends")
    g.add_argument("--detach", action="store_true", help="return after launching a local run")


def resume_point(rd: Any) -> str:
    """Where the trainer will resume: the step and folder of the newest complete checkpoint, or the start."""
    from relax_hpc.fsio import read_json
    from relax_hpc.trainer.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(rd)
    if ckpt is None:
        return "no complete checkpoint yet: the trainer starts again from step 0 (and runs its warm-up)"
    try:
        step = read_json(ckpt / "state.json", expect=dict).get("step")
    except (OSError, ValueError):
        step = None
    if not isinstance(step, int):
        step = int(ckpt.name.rpartition("_")[2]) if ckpt.name.rpartition("_")[2].isdigit() else "?"
    return f"resuming from step {step} (checkpoint {ckpt})"


def run(args: argparse.Namespace) -> int:
    import time

    from relax_hpc.launch.resume import resume_run
    from relax_hpc.rundir import RunDir

    rd = RunDir.open(args.run_dir)
    t0, point = time.time(), resume_point(rd)  # before the trainer starts (it may checkpoint again)
    result = resume_run(rd, executor=args.executor, dry_run=args.dry_run)
    print(point)
    if isinstance(result, dict):
        for job in result.get("jobs", []):
            print(f"submitted job {job['job_id']} ({job['kind']})")
        if args.wait and not args.dry_run:
            from relax_hpc.launch.follow import follow_slurm
            from relax_hpc.roles import load_run_config

            return follow_slurm(rd, load_run_config(rd))
        return 0
    for p in result:
        print(f"started {p.proc} (pid {p.popen.pid})")
    if args.detach:
        return 0
    from relax_hpc.launch.follow import follow_local
    from relax_hpc.roles import load_run_config

    return follow_local(rd, load_run_config(rd), result, since=t0)
