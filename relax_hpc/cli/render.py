"""``relax-hpc render RECIPE [--set k=v ...] [--run-dir DIR]``: print the plain sbatch script(s) of a recipe.

The scripts are what ``relax-hpc submit --executor slurm`` submits: read them, edit them, submit them by hand with
``sbatch``. They run the role entry points on ``RUN_DIR``, which must hold ``config.json``:
``relax-hpc submit RECIPE --executor slurm --dry-run --run-dir DIR`` writes it (and the scripts) without submitting,
on any machine (no Slurm needed: scripts can be prepared on a workstation).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set launch.placement=separate (repeatable)")
    p.add_argument("--run-dir", default=None, help="run directory the scripts use (default: runs/<name>-<time>)")


def run(args: argparse.Namespace) -> int:
    from relax_hpc.launch.checks import load_checked
    from relax_hpc.launch.sbatch import render_run
    from relax_hpc.launch.slurm_time import time_limit_warnings
    from relax_hpc.rundir import RunDir
    from relax_hpc.trainer.checks import check_trainer

    cfg = load_checked(args.recipe, args.overrides)  # a ConfigError prints one line per problem (cli.main)
    check_trainer(cfg)
    rd = RunDir(args.run_dir or Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    scripts = render_run(rd, cfg)
    for i, s in enumerate(scripts):
        if len(scripts) > 1:
            order = "first" if i == 0 else "next"
            print(f"{'' if i == 0 else chr(10)}# ==== {rd.slurm_script(s.name)} (submit {order})")
        print(s.text, end="")
    for w in time_limit_warnings(cfg, rd):
        print(f"warning: {w}", file=sys.stderr)
    if not rd.config.is_file():
        print(f"note: the scripts read {rd.config}; `relax-hpc submit {args.recipe} --executor slurm --dry-run "
              f"--run-dir {rd.root}` writes it and the scripts (no Slurm needed here)", file=sys.stderr)
    return 0
