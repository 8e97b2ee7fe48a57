"""``relax-hpc validate RECIPE [--set k=v ...]``: exit 0, or 2 with one line per problem."""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set algorithm.clip_high=0.28 (repeatable)")
    p.add_argument("--print", dest="print_config", action="store_true", help="print the resolved config as JSON")


def run(args: argparse.Namespace) -> int:
    from relax_hpc.config.load import config_to_json, load_recipe

    cfg = load_recipe(args.recipe, args.overrides)  # a ConfigError prints one line per problem (cli.main)
    if args.print_config:
        print(json.dumps(config_to_json(cfg), indent=2))
    else:
        print(f"ok: {args.recipe} ({cfg.mode}, {cfg.num_steps} steps, algorithm {cfg.algorithm.name})")
    return 0
