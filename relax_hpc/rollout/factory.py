"""The one factory of rollout engines: ``rollout.engine`` -> an implementation of :class:`RolloutEngine`. Apart from
the protocol (:mod:`relax_hpc.rollout.engine`), which every implementation imports, so that no import circles."""

from __future__ import annotations

from typing import Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.rollout.engine import RolloutEngine


def make_engine(cfg: RecipeConfig, *, device: str | None = None, seed: int = 0, tokenizer: Any,
                model: Any = None, colocated: bool = False, run_dir: Any = None, proc: str = "rollout-0",
                events: Any = None) -> RolloutEngine:
    """The engine ``cfg.rollout.engine`` names (dispatched once here). ``model``: the module to generate with, shared
    with the caller (colocate); None: the engine loads its own weights from ``cfg.model`` (a fully_async worker
    holds no model). ``colocated``: the engine runs beside the trainer in its process (colocate), with ``model`` or
    on a copy of its own where the trainer has no module to share. ``device``: where an in-process engine runs
    (default: ``rollout.device``, or the model's). ``seed``: the engine's sampling seed (requests without their own
    ``sampling.seed`` draw from it). Server engines (``sglang``, ``vllm``) also take the ``run_dir`` (their record,
    log and model folder), the process name ``proc`` and its ``events`` log (restarts, fallbacks, alerts)."""
    kind = cfg.rollout.engine
    if kind == "hf":
        from relax_hpc.rollout.hf_engine import from_config

        return from_config(cfg, device=device, seed=seed, tokenizer=tokenizer, model=model,
                           colocated=colocated or model is not None)
    if kind in ("sglang", "vllm"):
        from relax_hpc.rollout.server import make_server_engine

        if model is not None:  # colocate builds a server engine without the trainer's module
            raise ValueError(f"rollout.engine={kind}: a server engine generates with its server's own weights; it "
                             "takes no module")
        if run_dir is None:
            raise ValueError(f"rollout.engine={kind}: a server engine needs the run dir")
        dev = device or ("cpu" if cfg.rollout.device == "cpu" else "cuda")
        return make_server_engine(cfg, run_dir=run_dir, proc=proc, device=dev, seed=seed, tokenizer=tokenizer,
                                  events=events)
    raise ValueError(f"unknown rollout engine {kind!r}")
