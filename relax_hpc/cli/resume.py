"""``relax-hpc resume RUN_DIR``: resubmit a stopped run into the same run dir; the trainer resumes from its latest
checkpoint and the rollout workers rejoin at the latest weights."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("--executor", choices=("auto", "local", "slurm"), default=None,
                   help="where to run (default: where the run ran before)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch scripts; submit nothing")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--wait", action="store_true", help="follow a Slurm run until it ends")
    g.add_argument("--detach", action="store_true", help="return after launching a local run")


def run(args: argparse.Namespace) -> int:
    from relax_hpc.launch.resume import resume_run
    from relax_hpc.rundir import RunDir

    rd = RunDir.open(args.run_dir)
    result = resume_run(rd, executor=args.executor, dry_run=args.dry_run)
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

    return follow_local(rd, load_run_config(rd), result)
