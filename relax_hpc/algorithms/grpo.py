"""GRPO with DAPO's clip-higher: a clipped token-level surrogate on group-relative advantages.

Advantages (per sample ``i`` of group ``g``, broadcast to its tokens): ``A_i = (R_i - mean_g R) / (std_g R + eps)``
(population std), or ``R_i - mean_g R`` with ``std_normalize: false`` (Dr.GRPO).

Per masked-in response token ``t``, with ``r_t = exp(logp_t - old_logp_t)`` and the detached truncated importance
weight ``w_t = min(exp(old_logp_t - rollout_logp_t), tis_cap)`` (1 unless ``proximal``; see ``base.py``)::

    l_t  = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t) * w_t * sample_weight_t
    loss = agg(l) + kl_coef * agg(k(logp, ref_logp)) - entropy_coef * agg(entropy)

``agg`` is ``loss_agg`` on the step's global normaliser (``common.aggregate``) and ``k`` the ``kl_type`` estimator;
the KL is a loss term, never folded into the reward. Dropped: dual clipping of negative advantages at large ratios,
any value function, and a reference model when ``kl_coef == 0``.

Metrics (token means): ``train/pg_clipfrac`` = fraction of tokens whose clipped term was the smaller objective,
``train/ppo_kl`` = mean of ``old_logp - logp``, ``train/tis_weight_mean``, ``train/tis_clipfrac`` = fraction of tokens
truncated at the cap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from relax_hpc.algorithms.base import PG_CLIPFRAC, PPO_KL, LossInputs
from relax_hpc.algorithms.common import (
    clipped_surrogate,
    finish_loss,
    group_advantages,
    log_ratio,
    sample_weights,
    token_mean,
    token_tis,
)

if TYPE_CHECKING:
    from relax_hpc.config.schema import AlgorithmConfig


class GRPO:
    """The GRPO family (GRPO, Dr.GRPO, DAPO's clip-higher, decoupled PPO with ``proximal``)."""

    name = "grpo"

    def sequence_advantages(self, rewards: np.ndarray, group_ids: np.ndarray, cfg: AlgorithmConfig) -> np.ndarray:
        """[N] float32 group advantages, std-normalised unless ``cfg.std_normalize`` is False."""
        return group_advantages(rewards, group_ids, std_normalize=cfg.std_normalize)

    def loss(self, x: LossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
        """The clipped surrogate on ``x.advantages`` plus the KL and entropy terms (module docstring)."""
        return self.clipped_loss(x, cfg, x.advantages)

    def clipped_loss(self, x: LossInputs, cfg: AlgorithmConfig, advantages: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss with ``advantages`` [T] in place of ``x.advantages`` (subclasses shape their own)."""
        lr = log_ratio(x)
        pg, clipped = clipped_surrogate(torch.exp(lr), advantages, cfg.clip_low, cfg.clip_high)
        tis, metrics = token_tis(x, cfg.tis_cap)
        metrics[PG_CLIPFRAC] = token_mean(clipped, x)
        metrics[PPO_KL] = token_mean(-lr, x)
        return finish_loss(pg * tis * sample_weights(x), x, cfg, metrics)


ALGORITHM = GRPO()
