"""Checks of a validated config against what this version ships (no heavy imports)."""

from __future__ import annotations

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.errors import UserError


def check_backends(cfg: RecipeConfig) -> None:
    """Refuse, with one line, backends this version does not ship (before anything is launched)."""
    if cfg.trainer.backend != "torch":
        raise UserError(f"trainer.backend={cfg.trainer.backend}: not available in this version; use torch")
    if cfg.rollout.engine != "hf":
        raise UserError(f"rollout.engine={cfg.rollout.engine}: not available in this version; use hf")
