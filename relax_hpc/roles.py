"""Role entry: read the run dir's resolved config, set up logging to the run dir, dispatch to the mode's role."""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path
from typing import Any

from relax_hpc.launch.exitcodes import EXIT_FAILED, EXIT_USER_ERROR
from relax_hpc.rundir import RunDir, proc_name

log = logging.getLogger(__name__)


def load_run_config(run_dir: RunDir):  # -> RecipeConfig
    from relax_hpc.config.load import validate_dict
    from relax_hpc.errors import RunDirError
    from relax_hpc.fsio import read_json

    try:
        data = read_json(run_dir.config)
    except FileNotFoundError:
        raise RunDirError(f"{run_dir.config} is missing: was the run submitted with `relax-hpc submit`?") from None
    return validate_dict(data)


def _log_to_file(run_dir: RunDir, proc: str) -> None:
    path = run_dir.text_log(proc)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def _set_threads(cfg: Any, role: str) -> None:
    """Intra-op threads = the role's CPUs (oversubscribed OpenMP threads spin and slow everything down)."""
    import os

    import torch

    res = cfg.launch.trainer if role in ("trainer", "colocate") else cfg.launch.rollout
    n = int(os.environ.get("OMP_NUM_THREADS") or res.cpus_per_task)
    torch.set_num_threads(max(1, n))


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
    _set_threads(cfg, role)
    try:
        if role == "colocate":
            from relax_hpc.modes.colocate import run_colocate
            from relax_hpc.modes.dist import init_trainer_group

            world = cfg.trainer.num_ranks
            init_trainer_group(run_dir, rank, world, cfg.trainer.device)
            return run_colocate(run_dir, cfg, rank=rank, world_size=world)
        if role == "trainer":
            from relax_hpc.modes.async_trainer import run_async_trainer
            from relax_hpc.modes.dist import init_trainer_group

            world = cfg.trainer.num_ranks
            init_trainer_group(run_dir, rank, world, cfg.trainer.device)
            return run_async_trainer(run_dir, cfg, rank=rank, world_size=world)
        if role == "rollout":
            from relax_hpc.modes.async_rollout import run_rollout_worker

            return run_rollout_worker(run_dir, cfg, rank=rank)
        raise UserError(f"unknown role {role!r}")
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
