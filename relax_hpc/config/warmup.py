"""The ``warmup`` section: an optional supervised warm-up before RL."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relax_hpc.config.base import Section
from relax_hpc.config.data import TaskConfig


class SFTWarmupConfig(Section):
    """Optional supervised warm-up before RL (real RL starts from a supervised model; the demo uses a few steps)."""

    steps: int = Field(0, ge=0)
    """Supervised steps on (prompt, answer) pairs from the data (0 = none)."""
    lr: float = Field(1e-3, gt=0)
    """Learning rate of the warm-up."""
    batch_size: int = Field(32, ge=1)
    """Pairs per warm-up step."""
    task: TaskConfig | None = None
    """An easier built-in task for the warm-up; defaults to the data's task."""
    source: Literal["data", "env"] = "data"
    """Where the supervised examples come from: ``data``, (prompt, reference answer) pairs; ``env``, the episode
    environment's ``warmup_examples(task, rng)`` hook on the data's prompts (agentic recipes: ``rollout.env`` must
    name an environment that has the hook, see docs/agentic.md). With ``env``, ``batch_size`` counts prompts, each
    giving the environment's examples."""
