"""``relax-hpc scale RUN_DIR --rollout N``: add rollout workers (new array jobs, new ranks) or drain and cancel some,
while training goes on (Slurm, mode fully_async; adding needs placement separate)."""

from __future__ import annotations

import argparse

from relax_hpc.cli.args import seconds


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("--rollout", type=int, required=True, metavar="N", help="number of rollout workers wanted")
    p.add_argument("--timeout", type=seconds(), default=300.0,
                   help="seconds drained workers get to finish their batch before they are cancelled (default 300)")
    p.add_argument("--no-wait", action="store_true", help="ask workers to drain and return at once")


def run(args: argparse.Namespace) -> int:
    from relax_hpc.launch.slurm_scale import scale_rollout

    out = scale_rollout(args.run_dir, args.rollout, wait=not args.no_wait, timeout_s=args.timeout)
    msg = f"rollout workers: {out['before']} -> {out['after']}"
    if out["added"]:
        msg += f"; added ranks {out['added']} as job {' '.join(out['jobs'])}"
    if out["drained"]:
        msg += f"; drained ranks {out['drained']}"
    if out["cancelled"]:
        msg += f"; cancelled ranks {out['cancelled']}"
    print(msg)
    for w in out["warnings"]:
        print(f"warning: {w}")
    return 0
