"""What the rollout driver needs of a reward: :class:`RewardScorer` (scores of decoded responses) and the
:class:`RewardResult` it returns. The recipe's implementation is :class:`relax_hpc.rewards.runner.RewardRunner`; a
test or a benchmark may bring its own. Kept beside the driver so that the driver (rollout) does not import the
reward layer above it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RewardResult:
    """Scores of N responses."""

    rewards: np.ndarray
    """float32 [N]: the training reward (0 where the reward failed)."""
    extras: dict[str, np.ndarray]
    """name -> float32 [N]: the other keys of dict-valued rewards (NaN where a sample did not report the key)."""
    failed: np.ndarray
    """bool [N]: the reward raised, timed out or returned something that is not a finite number."""
    reasons: list[str | None]
    """Per sample: why it failed (None where it did not)."""
    dropped: np.ndarray
    """bool [N]: samples whose whole group the caller must drop (the failed ones when ``on_error`` is ``drop``)."""
    counts: dict[str, int] = field(default_factory=dict)
    """``reward/samples``, ``reward/errors`` (all failures), ``reward/timeouts`` (the part of them that timed out)."""

    @property
    def num_errors(self) -> int:
        """How many samples failed (``counts["reward/errors"]``)."""
        return int(self.failed.sum())

    def group_drop_mask(self, group_size: int) -> np.ndarray:
        """bool [N // group_size]: groups (consecutive runs of ``group_size`` samples) holding a sample to drop."""
        n = len(self.dropped)
        if group_size < 1 or n % group_size:
            raise ValueError(f"{n} samples do not split into groups of {group_size}")
        return self.dropped.reshape(n // group_size, group_size).any(axis=1)

    def metrics(self) -> dict[str, float]:
        """Scalars to log: counts, ``reward/mean`` over samples that did not fail, and the nan-mean of each extra."""
        ok = ~self.failed
        out: dict[str, float] = {k: float(v) for k, v in self.counts.items()}
        out["reward/mean"] = float(self.rewards[ok].mean()) if ok.any() else float("nan")
        for name, values in self.extras.items():
            finite = values[np.isfinite(values)]
            out[f"reward/{name}"] = float(finite.mean()) if finite.size else float("nan")
        return out


class RewardScorer(ABC):
    """What the rollout driver needs of a reward: scores of decoded responses, on the driver's loop when
    :attr:`on_loop`, and the metrics it reports. :class:`RewardRunner` is the recipe's; a test or a benchmark may
    bring its own."""

    on_loop: bool = False
    """Await :meth:`score_async` on the rollout driver's loop, where the engine's requests run (a reward that sends
    requests to the rollout's engine); False: the driver calls :meth:`score`."""

    @abstractmethod
    def score(self, responses: Sequence[str], answers: Sequence[Any],
              metas: Sequence[dict[str, Any]] | None = None) -> RewardResult:
        """Score ``responses[i]`` against ``answers[i]``; never raises because of the reward function."""

    async def score_async(self, responses: Sequence[str], answers: Sequence[Any],
                          metas: Sequence[dict[str, Any]] | None = None) -> RewardResult:
        """:meth:`score` on the running loop (default: :meth:`score` itself)."""
        return self.score(responses, answers, metas)

    def metrics(self) -> dict[str, float]:
        """Scalars to log with each batch's metrics (none by default)."""
        return {}
