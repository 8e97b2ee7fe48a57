"""The ``relax-hpc`` command. Thin: parses arguments, then imports the one subcommand module it needs.

Each subcommand is a module ``relax_hpc.cli.<name>`` with ``add_arguments(parser)`` and ``run(args) -> int``.
User errors (:class:`relax_hpc.errors.UserError`) print one line ``error: ...`` and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from relax_hpc import __version__

DESCRIPTION = """\
Reinforcement-learning post-training of language models (GRPO and its family) on a Slurm cluster or on one
machine. A recipe (YAML) describes the model, data, reward, algorithm and placement; `relax-hpc submit` starts the
run. The trainer and the rollout workers share nothing but one run directory on a shared filesystem, so generation
and training can overlap (mode fully_async) or take turns (mode colocate), and a killed or requeued role resumes
from the run directory."""

EPILOG = """\
examples:
  relax-hpc submit recipes/demo.yaml --executor local   the CPU demo: a tiny model learns a task in ~2 minutes
  relax-hpc validate RECIPE --set trainer.lr=1e-6       check a recipe and overrides before submitting
  relax-hpc submit RECIPE --executor slurm              on a Slurm cluster (the recipe's launch section)
  relax-hpc monitor RUN_DIR                             live view; then: status, plot, resume, cancel
`relax-hpc COMMAND --help` for a command's options. Documentation: README.md and docs/."""

# name -> (module, one-line help), in the order of the help. Modules are imported only when their command runs (or
# for --help of it).
COMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("relax_hpc.cli.submit", "start a run from a recipe (local processes or Slurm jobs)"),
    "validate": ("relax_hpc.cli.validate", "check a recipe and its overrides without starting anything"),
    "monitor": ("relax_hpc.cli.monitor", "live view of a run or a sweep: steps, rewards, roles"),
    "status": ("relax_hpc.cli.status", "job states and role heartbeats of a run"),
    "plot": ("relax_hpc.cli.plot", "plot a run's (or a sweep's) curves to a PNG"),
    "resume": ("relax_hpc.cli.resume", "start a stopped run again from its last checkpoint"),
    "cancel": ("relax_hpc.cli.cancel", "stop a run's jobs or processes"),
    "scale": ("relax_hpc.cli.scale", "add or remove rollout workers of a running fully_async run"),
    "render": ("relax_hpc.cli.render", "print the sbatch script(s) a recipe would submit"),
    "sweep": ("relax_hpc.cli.sweep", "submit a hyper-parameter grid as one job array"),
    "sweep-status": ("relax_hpc.cli.sweep_status", "table of final metrics per sweep combination"),
    "eval": ("relax_hpc.cli.eval", "evaluate a run's stored weight snapshots on its held-out set"),
    "export": ("relax_hpc.cli.export", "write a run's weight snapshot as an HF model folder (LoRA: --merge)"),
    "data": ("relax_hpc.cli.data", "list or make the data sets of the shipped recipes"),
    "bench": ("relax_hpc.cli.bench", "benchmarks that print figures beside a peer (docs/benchmarks.md)"),
    "role": ("relax_hpc.cli.role", "run one role of a run (what the launcher starts on each node)"),
}
HIDDEN = frozenset({"role"})
"""Commands that work but are not listed in ``--help``: the launcher's, not a user's."""


def _setup_logging(verbose: int) -> None:
    level = logging.WARNING if verbose < 0 else logging.INFO if verbose == 0 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    from relax_hpc.cli.args import OneLineParser

    parser = OneLineParser(prog="relax-hpc", description=DESCRIPTION, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"relax-hpc {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    for name, (module, help_) in COMMANDS.items():
        listed = {} if name in HIDDEN else {"help": help_}  # without help=, argparse lists no line for it
        p = sub.add_parser(name, description=help_, **listed)
        if only is None or only == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    from relax_hpc.errors import UserError

    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser(only=cmd if cmd in COMMANDS else None)
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help, --version (0) or a bad flag (2, one error line printed)
            return int(exc.code or 0) if not isinstance(exc.code, str) else 2
        if not args.command:
            parser.print_help()
            return 2
        _setup_logging(-1 if args.quiet else args.verbose)
        module = importlib.import_module(COMMANDS[args.command][0])
        return int(module.run(args) or 0)
    except UserError as exc:
        from relax_hpc.errors import ConfigError

        for line in exc.problems if isinstance(exc, ConfigError) else [str(exc)]:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
