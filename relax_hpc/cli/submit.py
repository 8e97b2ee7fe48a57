"""``relax-hpc submit RECIPE``: create the run dir, resolve the config, launch the roles.

``--executor auto`` (default) uses Slurm when ``sbatch`` is on PATH, local processes otherwise. Local runs are
followed until they end (``--detach`` to return at once); Slurm runs return after submission (``--wait`` to follow).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set mode=fully_async (repeatable)")
    p.add_argument("--executor", choices=("auto", "local", "slurm"), default=None,
                   help="where roles run (default: the recipe's launch.executor, auto)")
    p.add_argument("--run-dir", default=None, help="run directory (default: runs/<name>-<time>)")
    p.add_argument("--dry-run", action="store_true", help="write everything and print what would run; submit nothing")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--wait", action="store_true", default=None, help="follow the run until it ends (Slurm)")
    g.add_argument("--detach", action="store_true", help="return after launching (local)")


def default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare_run_dir(args: argparse.Namespace, cfg: Any = None, *, resume: bool = False) -> tuple[Any, Any]:
    """(RunDir, config): validate the recipe unless ``cfg`` is given, then create the run dir and write
    recipe.yaml + config.json (nothing is written before validation)."""
    from relax_hpc.config.load import config_to_json
    from relax_hpc.fsio import atomic_write_json, atomic_write_text
    from relax_hpc.launch.checks import load_checked
    from relax_hpc.rundir import RunDir

    if cfg is None:
        cfg = load_checked(args.recipe, args.overrides)
    root = Path(args.run_dir) if args.run_dir else default_run_dir(cfg.name)
    run_dir = RunDir.create(root, name=cfg.name, resume=resume)
    text = Path(args.recipe).read_text()
    if args.overrides:
        text += "\n# overrides given on the command line:\n" + "".join(f"#   --set {o}\n" for o in args.overrides)
    atomic_write_text(run_dir.recipe, text)
    atomic_write_json(run_dir.config, config_to_json(cfg))
    return run_dir, cfg


def pick_executor(want: str, *, dry_run: bool = False) -> str:
    """``auto``: Slurm when sbatch is on PATH and the controller answers; else local processes. A dry run on Slurm
    only renders the scripts, so it needs no Slurm here."""
    from relax_hpc.errors import UserError

    if want == "local" or (want == "slurm" and dry_run):
        return want
    if shutil.which("sbatch") is None:
        if want == "slurm":
            raise UserError("--executor slurm: no Slurm here (sbatch is not on PATH)")
        return "local"
    from relax_hpc.launch.slurm_cli import slurm_problem

    problem = slurm_problem()
    if problem is None:
        return "slurm"
    if want == "slurm":
        raise UserError(f"--executor slurm: {problem}")
    print(f"note: not using Slurm ({problem}); running locally", file=sys.stderr)
    return "local"


def run(args: argparse.Namespace) -> int:
    from relax_hpc.launch.checks import load_checked

    cfg = load_checked(args.recipe, args.overrides)  # a ConfigError prints one line per problem (cli.main)
    from relax_hpc.weights.transport import deprecation, resolve

    resolve(cfg, warn=False)  # a weights.transport the mode or engine cannot use: one line (cli.main)
    if (old := deprecation(cfg)) is not None:
        print(f"warning: {old}", file=sys.stderr)
    from relax_hpc.trainer.checks import check_trainer

    check_trainer(cfg)
    executor = pick_executor(args.executor or cfg.launch.executor, dry_run=args.dry_run)
    from relax_hpc.launch.preflight import preflight, start_warnings

    # before any process starts or the run dir is created; a dry run for Slurm runs elsewhere: warnings only
    for warning in [*preflight(cfg, executor=executor, lenient=args.dry_run and executor == "slurm"),
                    *start_warnings(cfg)]:
        print(f"warning: {warning}", file=sys.stderr)
    run_dir, cfg = prepare_run_dir(args, cfg)
    print(f"run dir: {run_dir.root}")
    if executor == "slurm":
        from relax_hpc.launch.slurm import launch as slurm_launch

        result = slurm_launch(run_dir, cfg, dry_run=args.dry_run)
        for job in result.get("jobs", []):
            print(f"submitted job {job.get('job_id')} ({job.get('kind', job.get('role'))})")
        if args.wait and not args.dry_run:
            from relax_hpc.launch.follow import follow_slurm

            return follow_slurm(run_dir, cfg)
        return 0
    from relax_hpc.launch import local

    if args.dry_run:
        for role, rank in local.role_plan(cfg):
            print(f"would start: {sys.executable} -m relax_hpc role {role} --run-dir {run_dir.root} --rank {rank}")
        return 0
    procs = local.launch(run_dir, cfg)
    for p in procs:
        print(f"started {p.proc} (pid {p.popen.pid})")
    if args.detach:
        return 0
    from relax_hpc.launch.follow import follow_local

    return follow_local(run_dir, cfg, procs)
