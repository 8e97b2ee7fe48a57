"""Checks of a validated config against what this version ships (no heavy imports)."""

from __future__ import annotations

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.errors import UserError


def check_backends(cfg: RecipeConfig) -> None:
    """Refuse, with one line, backends this version does not ship (before anything is launched)."""
    from relax_hpc.trainer.backend import BACKENDS

    if cfg.trainer.backend not in BACKENDS:
        raise UserError(f"trainer.backend={cfg.trainer.backend}: not available in this version; use "
                        f"{' or '.join(sorted(BACKENDS))}")


def check_megatron(cfg: RecipeConfig) -> None:
    """A ``trainer.backend: megatron`` recipe: parallel layout against the model, its weight mapping, megatron-core
    installed (one :class:`UserError` naming the fix). Run by the schema, so ``relax-hpc validate`` refuses it."""
    from relax_hpc.trainer.megatron.config import check_recipe

    check_recipe(cfg)
