"""``python -m relax_hpc.launch.torchrun TORCHRUN_ARGS -m relax_hpc role ROLE --run-dir DIR``: torchrun for one
node of a role (``launch.trainer.launcher: torchrun``; the sbatch scripts run it as the node's one Slurm task).

It is ``torch.distributed.run`` with two things the sbatch scripts rely on:

- SIGUSR2 (the time-limit / preemption warning Slurm sends) is forwarded to the ranks like SIGTERM, and the ranks get
  ``--shutdown-timeout`` seconds (the signal delay) to checkpoint before torchrun kills them;
- the exit status is the ranks' own: 3 (checkpointed, requeue me) when every failed rank exited 3 or when a
  forwarded signal stopped them, else the first failed rank's status (torchrun itself always exits 1).
"""

from __future__ import annotations

import sys

SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"
"""Signals torchrun forwards to the ranks."""


def launcher_args(argv: list[str]) -> list[str]:
    """``argv`` (torchrun's arguments) with the forwarded signals first."""
    return [f"--signals-to-handle={SIGNALS}", *argv]


def exit_status(codes: list[int]) -> int:
    """The status of the node's launch from its failed ranks' exit codes (module docstring)."""
    if not codes:
        return 0
    if all(c == 3 for c in codes):
        return 3
    first = next(c for c in codes if c != 3)
    return 128 - first if first < 0 else first or 1  # killed by signal N: 128 + N, as the shell reports it


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(launcher_args(list(sys.argv[1:] if argv is None else argv)))
    try:
        run(args)
    except ChildFailedError as exc:
        return exit_status([int(f.exitcode) for f in exc.failures.values()])
    except SignalException as exc:  # forwarded to the ranks, which checkpointed within the shutdown timeout
        print(f"relax-hpc torchrun: {exc.sigval.name} forwarded to the ranks; exiting for requeue", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
