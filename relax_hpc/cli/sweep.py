"""``relax-hpc sweep RECIPE --grid algorithm.lr=1e-6,3e-6 [--grid ...] [--parallel P] [--sweep-dir DIR]``.

Every combination of the grid becomes a complete run in its own run dir under the sweep dir. On Slurm: ONE job
array, one task per combination, at most P at once. Locally: the local executor, P combinations at a time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from relax_hpc.cli.args import seconds


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="a swept field and its values (repeatable: the grid is their product)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every combination (repeatable)")
    p.add_argument("--parallel", type=int, default=None,
                   help="combinations running at once (default: all on Slurm, 1 locally)")
    p.add_argument("--sweep-dir", default=None, help="where the sweep lives (default: sweeps/<name>-<time>)")
    p.add_argument("--executor", choices=("auto", "local", "slurm"), default="auto",
                   help="auto: Slurm when it answers, else local processes")
    p.add_argument("--timeout", type=seconds(), default=86_400.0, help="local sweeps: stop after this many seconds")


def run(args: argparse.Namespace) -> int:
    from relax_hpc.config.load import load_recipe
    from relax_hpc.launch import sweep
    from relax_hpc.launch.slurm_cli import slurm_available

    executor = args.executor
    if executor == "auto":
        executor = "slurm" if slurm_available() else "local"
    combos = sweep.combinations(sweep.parse_grid(args.grid))
    parallel = args.parallel or (len(combos) if executor == "slurm" else 1)
    sweep_dir = args.sweep_dir
    if sweep_dir is None:
        name = load_recipe(args.recipe, args.overrides).name
        sweep_dir = Path("sweeps") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    sd, manifest, cfgs = sweep.prepare(args.recipe, args.grid, sweep_dir, overrides=args.overrides,
                                       executor=executor, parallel=parallel)
    print(f"sweep dir: {sd.root} ({len(cfgs)} combination(s), {parallel} at once, executor {executor})")
    if executor == "slurm":
        rec = sweep.submit_slurm(sd, manifest, cfgs)
        print(f"submitted job array {rec['array_job_id']} (tasks 0-{len(cfgs) - 1}); "
              f"results: relax-hpc sweep-status {sd.root}")
        return 0
    codes = sweep.run_local(sd, manifest, timeout_s=args.timeout)
    print(sweep.format_sweep_status(sweep.sweep_status(sd)))
    failed = sorted(i for i, c in codes.items() if c != 0)
    if failed:
        print(f"combination(s) {failed} failed; their output is in {sd.logs}", file=sys.stderr)
    return 1 if failed else 0
