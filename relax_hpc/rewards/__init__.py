"""Rewards: the function interface (sync/async, single/batched, dict-valued), built-ins and the batch runner.

Imports are lazy so that validating a recipe (which checks the reward name) stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "batched": "relax_hpc.rewards.api", "is_async": "relax_hpc.rewards.api", "is_batched": "relax_hpc.rewards.api",
    "BUILTIN": "relax_hpc.rewards.registry", "check_reward": "relax_hpc.rewards.registry",
    "resolve_reward": "relax_hpc.rewards.registry",
    "RewardResult": "relax_hpc.rewards.runner", "RewardRunner": "relax_hpc.rewards.runner",
    "RewardScorer": "relax_hpc.rewards.runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'relax_hpc.rewards' has no attribute {name!r}")
