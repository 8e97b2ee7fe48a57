"""``relax-hpc eval RUN_DIR``: evaluate a run's stored weight snapshots after the fact, with the run's own recipe
(its ``config.json``; the recipe must have an ``eval`` section, or one is given with ``--set``).

Each snapshot goes into one engine built as a fully_async rollout worker builds it (the recipe's ``rollout``
section; no trainer, no model of its own beyond the engine's), through ``engine.receive`` (checked against the
snapshot's manifest), and the held-out set runs through :class:`~relax_hpc.eval.evaluator.Evaluator`: the same files
and ``eval/*`` metric records (in an ``eval-<pid>`` event log) as during training. Versions that already have an
evaluation are skipped unless ``force``. Only complete snapshots the run still keeps can be evaluated
(``weights.keep_last`` bounds them; ``weights/pins`` keeps more).
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.errors import UserError
from relax_hpc.rundir import RunDir

log = logging.getLogger(__name__)
_VERSION = re.compile(r"^v?(\d{1,9})$")


def run_config(rd: RunDir, overrides: list[str] | None = None) -> RecipeConfig:
    """The run's resolved recipe (``config.json``) with ``overrides``; it must have an ``eval`` section."""
    from relax_hpc.config.load import apply_overrides, validate_dict
    from relax_hpc.errors import ConfigError
    from relax_hpc.fsio import read_json
    from relax_hpc.launch.checks import check_plugins

    if not rd.config.is_file():
        raise UserError(f"{rd.config} is missing: this run dir was never submitted")
    try:
        cfg = check_plugins(validate_dict(apply_overrides(read_json(rd.config, expect=dict), overrides or [])))
    except ConfigError:
        raise
    except ValueError as exc:
        raise UserError(f"{rd.config}: {exc}") from None
    if cfg.eval is None:
        raise UserError(f"run {rd.root.name} has no eval section; give one, e.g. --set eval.data.path=HELD_OUT.jsonl")
    return cfg


def select_snapshots(spec: str, available: list[int]) -> list[int]:
    """``all`` or ``vN,vM,...`` (or plain numbers) -> versions, each of them a complete stored snapshot."""
    if not available:
        raise UserError("the run has no complete weight snapshot to evaluate")
    if spec.strip() == "all":
        return list(available)
    out: list[int] = []
    for part in spec.split(","):
        m = _VERSION.match(part.strip())
        if m is None:
            raise UserError(f"--snapshots: {part.strip()!r} is not a version (use all, or vN,vM,... e.g. v0,v50)")
        v = int(m.group(1))
        if v not in available:
            shown = ", ".join(f"v{a}" for a in available[:20]) + (" ..." if len(available) > 20 else "")
            raise UserError(f"--snapshots: v{v} is not a complete stored snapshot (stored: {shown})")
        if v not in out:
            out.append(v)
    return out


def build_engine(rd: RunDir, cfg: RecipeConfig, tokenizer: Any, proc: str, events: Any) -> Any:
    from relax_hpc.modes import components as C
    from relax_hpc.trainer.checks import check_backends

    check_backends(cfg)
    return C.build_engine(cfg, tokenizer, seed=cfg.seed, run_dir=rd, proc=proc, events=events)


def evaluate_snapshots(rd: RunDir, cfg: RecipeConfig, versions: list[int], *, force: bool = False,
                       echo: Any = print) -> dict[int, dict[str, float]]:
    """Evaluate ``versions`` in order; returns version -> metrics of those evaluated now."""
    import asyncio

    from relax_hpc.eval.evaluator import Evaluator, done_versions, write_result
    from relax_hpc.events import EventLog
    from relax_hpc.models.load import load_tokenizer
    from relax_hpc.rollout.engine import SnapshotFolder

    todo = versions if force else [v for v in versions if v not in done_versions(rd)]
    skipped = len(versions) - len(todo)
    if skipped:
        echo(f"{skipped} snapshot(s) already evaluated (eval/vNNNNNN.json); --force evaluates them again")
    if not todo:
        return {}
    tok = load_tokenizer(cfg.model)
    evaluator = Evaluator(cfg, tok)
    events = EventLog(rd, "eval", os.getpid())
    loop = asyncio.new_event_loop()
    out: dict[int, dict[str, float]] = {}
    try:
        engine = build_engine(rd, cfg, tok, events.proc, events)
        try:
            for v in todo:
                loop.run_until_complete(engine.receive(v, SnapshotFolder(rd.snapshot(v), verify=cfg.weights.verify)))
                res = evaluator.evaluate(engine, v, loop.run_until_complete)
                write_result(rd, res, proc=events.proc)
                events.metrics(res.metrics, step=v)
                out[v] = res.metrics
                echo(f"v{v}: accuracy {res.metrics.get('eval/accuracy', 0.0):.4f}  thresholded "
                     f"{res.metrics.get('eval/accuracy_thresholded', 0.0):.4f}  response length "
                     f"{res.metrics.get('eval/response_length', 0.0):.1f}  ({res.seconds:.1f}s)")
        finally:
            loop.run_until_complete(engine.close())
    finally:
        loop.close()
        events.close()
    return out
