"""The engine interface: small on purpose, so an in-process engine and a server-per-node engine both fit.

An engine turns prompt token ids into ``n`` completions each, with the per-token log-probs of the sampled tokens under
the sampling distribution (logits / temperature), and takes new weights between (or inside) generation batches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np


@dataclass
class Completion:
    """One sampled response."""

    token_ids: np.ndarray
    """[R] int32 response tokens (the EOS token included when generation stopped on it)."""
    logprobs: np.ndarray
    """[R] float32 log-probs of those tokens under the sampling policy."""
    finish_reason: Literal["stop", "length"]
    """``stop``: EOS or a stop string; ``length``: max_new_tokens reached."""
    version_first: int = 0
    """Weight version when generation of this response started."""
    version_last: int = 0
    """Weight version when it finished (differs if weights changed mid-generation)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent, e.g. ``generate``."""


class RolloutEngine(ABC):
    """Generates completions; holds one version of the policy weights."""

    version: int = 0

    @abstractmethod
    def generate(self, prompts: list[list[int]], n: int, *,
                 multimodal: list[dict[str, Any] | None] | None = None) -> list[list[Completion]]:
        """``n`` completions for each prompt (outer list: prompts)."""

    @abstractmethod
    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load new weights (full, unsharded names) and record their version."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (servers, GPU memory)."""


def make_engine(kind: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine a recipe names (dispatched once here)."""
    if kind == "hf":
        from relax_hpc.rollout.hf_engine import HFEngine

        return HFEngine(**kwargs)
    if kind == "sglang":
        from relax_hpc.errors import UserError

        raise UserError("rollout.engine=sglang: the SGLang engine (a server per node) is not available in this "
                        "version; use rollout.engine=hf")
    raise ValueError(f"unknown rollout engine {kind!r}")
