"""``relax-hpc validate RECIPE [--set k=v ...]``: exit 0, or 2 with one line per problem.

A problem of the recipe (schema, model folder, data rows) is an error. A problem of this machine (no GPU, the data
not made yet) is an error for a local run and a warning with ``--executor slurm``: the job runs elsewhere.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set algorithm.clip_high=0.28 (repeatable)")
    p.add_argument("--executor", choices=("auto", "local", "slurm"), default=None,
                   help="where the run would go, for the device checks (default: the recipe's launch.executor)")
    p.add_argument("--no-preflight", action="store_true",
                   help="check the recipe only; do not open the model, tokenizer and data")
    p.add_argument("--print", dest="print_config", action="store_true", help="print the resolved config as JSON")


def run(args: argparse.Namespace) -> int:
    from relax_hpc.config.load import config_to_json
    from relax_hpc.launch.checks import load_checked
    from relax_hpc.trainer.checks import check_trainer

    cfg = load_checked(args.recipe, args.overrides)  # a ConfigError prints one line per problem (cli.main)
    check_trainer(cfg)  # the backend's own checks (megatron: the layout against the model)
    from relax_hpc.weights.transport import deprecation, resolve

    resolve(cfg, warn=False)  # a weights.transport the mode or engine cannot use: one line (cli.main)
    if (old := deprecation(cfg)) is not None:
        print(f"warning: {old}", file=sys.stderr)
    if not args.no_preflight:
        from relax_hpc.launch.preflight import preflight, resolve_executor, start_warnings

        # what this machine lacks (a GPU, the data) is an error for a local run, a warning for a Slurm one
        executor = resolve_executor(args.executor or cfg.launch.executor)
        for warning in [*preflight(cfg, executor=executor, lenient=executor == "slurm"), *start_warnings(cfg)]:
            print(f"warning: {warning}", file=sys.stderr)
    if args.print_config:
        print(json.dumps(config_to_json(cfg), indent=2))
    else:
        print(f"ok: {args.recipe} ({cfg.mode}, {cfg.num_steps} steps, algorithm {cfg.algorithm.name})")
    return 0
