"""Role entry: read the run dir's resolved config, set up logging to the run dir, run the role's loop.

Which loop a role runs, and whether its ranks form a process group first, comes from :mod:`relax_hpc.roles.spec`.
"""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path
from typing import Any

from relax_hpc.lifecycle import EXIT_FAILED, EXIT_USER_ERROR
from relax_hpc.roles.spec import RoleSpec, num_ranks, resources, role_spec
from relax_hpc.rundir import RunDir, proc_name

log = logging.getLogger(__name__)


def load_run_config(run_dir: RunDir):  # -> RecipeConfig
    from relax_hpc.config.load import validate_resolved
    from relax_hpc.errors import RunDirError
    from relax_hpc.fsio import read_json

    try:
        data = read_json(run_dir.config, expect=dict)
    except FileNotFoundError:
        raise RunDirError(f"{run_dir.config} is missing: was the run submitted with `relax-hpc submit`?") from None
    return validate_resolved(data)


def _log_to_file(run_dir: RunDir, proc: str) -> None:
    path = run_dir.text_log(proc)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def _set_threads(cfg: Any, role: RoleSpec) -> None:
    """Intra-op threads = the role's CPUs (oversubscribed OpenMP threads spin and slow everything down)."""
    import os

    import torch

    n = int(os.environ.get("OMP_NUM_THREADS") or resources(cfg, role).cpus_per_task)
    torch.set_num_threads(max(1, n))


def run_loop(run_dir: RunDir, cfg: Any, role: RoleSpec, rank: int) -> int:
    """Join the role's process group when it has one, then run its loop. Returns the loop's exit code."""
    loop = role.load_loop()
    if role.group is None:
        return loop(run_dir, cfg, rank=rank)
    from relax_hpc.modes.dist import init_trainer_group

    world = num_ranks(cfg, role)
    init_trainer_group(run_dir, rank, world, cfg.trainer.device)
    return loop(run_dir, cfg, rank=rank, world_size=world)


def run_role(run_dir_path: str | Path, role: str, rank: int) -> int:
    """Run ``role`` rank ``rank`` of the run in ``run_dir_path``. Returns the process exit code.

    With ``RELAX_HPC_PROFILE=DIR`` in the environment the role runs under cProfile and writes ``DIR/<proc>.prof``
    (read it with ``python -m pstats``).
    """
    import os

    out = os.environ.get("RELAX_HPC_PROFILE")
    if not out:
        return _run_role(run_dir_path, role, rank)
    import cProfile

    prof = cProfile.Profile()
    try:
        return prof.runcall(_run_role, run_dir_path, role, rank)
    finally:
        Path(out).mkdir(parents=True, exist_ok=True)
        prof.dump_stats(Path(out) / f"{proc_name(role, rank)}.prof")


def _run_role(run_dir_path: str | Path, role: str, rank: int) -> int:
    from relax_hpc.errors import UserError
    from relax_hpc.events import EventLog

    run_dir = RunDir.open(run_dir_path)
    run_dir.ensure_layout()
    proc = proc_name(role, rank)
    _log_to_file(run_dir, proc)
    cfg = load_run_config(run_dir)
    try:
        spec = role_spec(role)
        _set_threads(cfg, spec)
        return run_loop(run_dir, cfg, spec, rank)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        EventLog(run_dir, role, rank).event("failed", str(exc), level="error")
        return EXIT_USER_ERROR
    except Exception as exc:
        tb = traceback.format_exc()
        log.error("role %s failed:\n%s", proc, tb)
        print(tb, file=sys.stderr)
        EventLog(run_dir, role, rank).event("failed", f"{type(exc).__name__}: {exc}", level="error")
        return EXIT_FAILED
