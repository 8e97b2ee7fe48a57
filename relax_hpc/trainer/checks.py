"""Checks of a validated recipe against the trainer backends this version ships (no torch imported).

The schema (``relax_hpc.config``) checks a recipe on its own; what needs a backend's knowledge (is it shipped, does
the megatron layout fit the model, is megatron-core installed) is checked here, above the config layer:
``relax-hpc validate`` and ``submit`` run :func:`check_trainer`, the roles :func:`check_backends`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_hpc.errors import UserError
from relax_hpc.trainer.backend import BACKENDS

if TYPE_CHECKING:
    from relax_hpc.config.schema import RecipeConfig


def check_backends(cfg: RecipeConfig) -> None:
    """Refuse, with one line, backends this version does not ship (before anything is launched)."""
    if cfg.trainer.backend not in BACKENDS:
        raise UserError(f"trainer.backend={cfg.trainer.backend}: not available in this version; use "
                        f"{' or '.join(sorted(BACKENDS))}")


def check_trainer(cfg: RecipeConfig) -> None:
    """:func:`check_backends`, then the selected backend's own checks: for ``megatron``, the parallel layout against
    the model, its weight mapping and megatron-core installed (one :class:`UserError` naming the fix)."""
    check_backends(cfg)
    if cfg.trainer.backend == "megatron":
        from relax_hpc.trainer.megatron.config import check_recipe

        check_recipe(cfg)
