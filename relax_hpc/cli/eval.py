"""``relax-hpc eval RUN_DIR [--snapshots all|vN,...] [--executor local|slurm]``: evaluate stored weight snapshots
on the run's held-out set after the fact (:mod:`relax_hpc.eval.offline`). ``local`` evaluates them here, one after
the other; ``slurm`` submits one job array over them (array task id = version; ``--dry-run`` prints the script)."""

from __future__ import annotations

import argparse

from relax_hpc.errors import UserError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run dir")
    p.add_argument("--snapshots", default="all", help="all (default), or versions: v0,v50,... (stored ones only)")
    p.add_argument("--executor", choices=("local", "slurm"), default="local",
                   help="local: evaluate here (default); slurm: a job array, one task per snapshot")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override the run's recipe, e.g. eval.n_samples=4 or eval.data.path=held.jsonl (repeatable)")
    p.add_argument("--force", action="store_true", help="evaluate snapshots that already have an evaluation again")
    p.add_argument("--dry-run", action="store_true", help="slurm: print the sbatch script, submit nothing")


def run(args: argparse.Namespace) -> int:
    from relax_hpc.eval.offline import run_config, select_snapshots
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights.manifest import complete_versions

    try:
        rd = RunDir.open(args.run_dir)
    except (OSError, ValueError) as exc:
        raise UserError(str(exc)) from None
    cfg = run_config(rd, args.overrides)
    versions = select_snapshots(args.snapshots, complete_versions(rd))
    if args.executor == "slurm":
        return _slurm(rd, cfg, versions, args)
    if args.dry_run:
        raise UserError("--dry-run shows the sbatch script: it needs --executor slurm")
    from relax_hpc.eval.offline import evaluate_snapshots

    done = evaluate_snapshots(rd, cfg, versions, force=args.force)
    print(f"evaluated {len(done)} snapshot(s); results in {rd.evals}")
    return 0


def _slurm(rd: object, cfg: object, versions: list[int], args: argparse.Namespace) -> int:
    from relax_hpc.eval.evaluator import done_versions
    from relax_hpc.launch.sbatch import render_eval_array
    from relax_hpc.launch.slurm import require_slurm, submit_scripts

    if not args.force:
        done = done_versions(rd)  # type: ignore[arg-type]
        versions = [v for v in versions if v not in done]
        if not versions:
            print("every selected snapshot already has an evaluation (eval/vNNNNNN.json); --force evaluates again")
            return 0
    extra = [a for o in args.overrides for a in ("--set", o)] + (["--force"] if args.force else [])
    script = render_eval_array(rd, cfg, versions, extra_args=extra)  # type: ignore[arg-type]
    if args.dry_run:
        print(script.text, end="")
        return 0
    require_slurm()
    entry = submit_scripts(rd, [script])[0]  # type: ignore[arg-type]
    print(f"submitted evaluation of {len(versions)} snapshot(s) as Slurm job array {entry['job_id']} "
          f"(script {entry['script']})")
    return 0
