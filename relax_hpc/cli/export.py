"""``relax-hpc export RUN_DIR [--version N] [--merge] [--out DIR]``: one of a run's weight snapshots (the newest by
default) as an HF model folder (:mod:`relax_hpc.models.export`). A LoRA run's snapshot is its adapter folder, or
with ``--merge`` the base model with the adapter merged in (loadable without PEFT)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="the run dir")
    p.add_argument("--version", type=int, default=None, help="the snapshot version (default: the newest)")
    p.add_argument("--merge", action="store_true",
                   help="model.lora runs: merge the adapter into the base model (an HF folder without PEFT)")
    p.add_argument("--out", type=Path, default=None,
                   help="the folder to write (must not exist; default RUN_DIR/exports/vNNNNNN[-merged])")


def run(args: argparse.Namespace) -> int:
    from relax_hpc.config.load import validate_resolved
    from relax_hpc.errors import UserError
    from relax_hpc.fsio import read_json
    from relax_hpc.models.export import export_snapshot
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights.manifest import complete_versions

    try:
        rd = RunDir.open(args.run_dir)
        data = read_json(rd.config, expect=dict)
    except (OSError, ValueError) as exc:
        raise UserError(str(exc)) from None
    cfg = validate_resolved(data)
    versions = complete_versions(rd)
    if not versions:
        raise UserError(f"run {rd.root} has no complete weight snapshot yet")
    version = versions[-1] if args.version is None else args.version
    if version not in versions:
        raise UserError(f"no complete snapshot v{version} in {rd.weights} (stored: {', '.join(map(str, versions))})")
    out = args.out or rd.exported(version, merged=args.merge)
    what = export_snapshot(cfg, rd.snapshot(version), out, merge=args.merge)
    print(f"exported snapshot v{version}, {what}, to {out}")
    return 0
