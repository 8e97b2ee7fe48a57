"""``relax-hpc role ROLE --run-dir DIR [--rank N]``: run one role of a run (what launchers start on each node).

The run dir must hold ``config.json`` (written by ``relax-hpc submit``). Exit codes: 0 done, 1 failed, 2 bad input,
3 checkpointed after SIGUSR2/SIGTERM and wants a requeue (see relax_hpc.lifecycle). The roles and their loops are the
table in relax_hpc.roles.spec. With ``--supervise`` (Slurm job steps) the role runs as a child process that is started
again when it dies (relax_hpc.launch.supervisor).
"""

from __future__ import annotations

import argparse
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    from relax_hpc.roles.spec import role_names

    p.add_argument("role", choices=role_names(), help="which role to run")
    p.add_argument("--run-dir", required=True, help="the run directory")
    p.add_argument("--rank", type=int, default=None,
                   help="rank within the role (default: $RELAX_RANK, torchrun's $RANK, $SLURM_PROCID, else 0)")
    p.add_argument("--supervise", action="store_true",
                   help="run the role as a child process and restart it when it dies (what Slurm job steps run; "
                        "relax_hpc.launch.supervisor)")


def default_rank() -> int:
    """``RELAX_RANK``; under torchrun its ``RANK`` (``SLURM_PROCID`` is then the node's task); ``SLURM_PROCID``."""
    torchrun = "RANK" if "TORCHELASTIC_RUN_ID" in os.environ else "RELAX_RANK"
    for var in ("RELAX_RANK", torchrun, "SLURM_PROCID"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def run(args: argparse.Namespace) -> int:
    from relax_hpc.roles import run_role

    rank = args.rank if args.rank is not None else default_rank()
    if args.supervise:
        from relax_hpc.launch.supervisor import run_supervised

        return run_supervised(args.run_dir, args.role, rank)
    code = run_role(args.run_dir, args.role, rank)
    # A role may leave communication threads blocked inside gloo/NCCL (the weight fast path); letting the
    # interpreter tear them down aborts the process. Everything durable is already on disk: flush and leave.
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
