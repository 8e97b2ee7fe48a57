"""``relax-hpc role ROLE --run-dir DIR [--rank N]``: run one role of a run (what launchers start on each node).

The run dir must hold ``config.json`` (written by ``relax-hpc submit``). Exit codes: 0 done, 1 failed, 2 bad input,
3 checkpointed after SIGUSR2/SIGTERM and wants a requeue (see relax_hpc.launch.exitcodes).
"""

from __future__ import annotations

import argparse
import os

ROLES = ("trainer", "rollout", "colocate")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("role", choices=ROLES, help="which role to run")
    p.add_argument("--run-dir", required=True, help="the run directory")
    p.add_argument("--rank", type=int, default=None,
                   help="rank within the role (default: $SLURM_ARRAY_TASK_ID for arrays, else $SLURM_PROCID, else 0)")


def default_rank() -> int:
    for var in ("RELAX_RANK", "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def run(args: argparse.Namespace) -> int:
    from relax_hpc.roles import run_role

    rank = args.rank if args.rank is not None else default_rank()
    code = run_role(args.run_dir, args.role, rank)
    # A role may leave communication threads blocked inside gloo/NCCL (the weight fast path); letting the
    # interpreter tear them down aborts the process. Everything durable is already on disk: flush and leave.
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
