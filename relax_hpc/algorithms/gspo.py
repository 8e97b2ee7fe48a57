"""GSPO: the importance ratio and its clip are per sequence, not per token.

Sequence ratio (length-normalised, over the sequence's masked-in tokens ``y_i``)::

    s_i = exp( mean_{t in y_i} (logp_t - old_logp_t) )

It is used in the token form of the paper (GSPO-token), ``s_it = sg[s_i] * exp(logp_t - sg[logp_t])``: its value is
``s_i`` for every token, so the clip decision is the sequence's, and its gradient is ``s_i * grad logp_t``. With
``loss_agg: seq_mean_token_mean`` (the paper's ``1/|y_i|`` average) and a per-sequence advantage, the loss and its
gradient equal the sequence form ``-mean_i min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)``; other
``loss_agg`` modes re-weight the same per-token terms (``token_mean`` weighs a sequence by its length). The paper
uses far narrower ranges than GRPO (about 3e-4 / 4e-4); ``clip_low`` / ``clip_high`` are used as given.

Truncated IS is applied per *sequence*: ``w_i = min(exp(mean_t (old_logp_t - rollout_logp_t)), tis_cap)``, the
geometric mean of the token ratios, truncated, and detached. Per token::

    l_t  = -min(s_it A_t, clip(s_it, 1 - clip_low, 1 + clip_high) A_t) * w_i * sample_weight_t
    loss = agg(l) + kl_coef * agg(kl) - entropy_coef * agg(entropy)

Advantages as GRPO's. Metrics are token means as in GRPO, with ``train/tis_clipfrac`` the fraction of tokens whose
sequence weight was truncated and ``train/ppo_kl`` the token-level ``old_logp - logp``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from relax_hpc.algorithms.base import PG_CLIPFRAC, PPO_KL, TIS_CLIPFRAC, TIS_WEIGHT_MEAN, LossInputs
from relax_hpc.algorithms.common import (
    clipped_surrogate,
    finish_loss,
    log_ratio,
    masked,
    sample_weights,
    seq_sum,
    token_mean,
)
from relax_hpc.algorithms.grpo import GRPO

if TYPE_CHECKING:
    from relax_hpc.config.schema import AlgorithmConfig


def seq_mean(values: Tensor, x: LossInputs) -> Tensor:
    """[S] mean of [T] ``values`` over each sequence's masked-in tokens (0 for a sequence with none)."""
    return seq_sum(masked(values, x), x) / seq_sum(x.loss_mask.to(values.dtype), x).clamp_min(1.0)


class GSPO(GRPO):
    """Group Sequence Policy Optimization (token form)."""

    name = "gspo"

    def loss(self, x: LossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
        """Sequence-ratio clipped surrogate plus the KL and entropy terms (module docstring)."""
        lr = log_ratio(x)
        log_s = seq_mean(lr, x).detach()[x.seq_ids]  # [T] log s_i of each token's sequence
        ratio = torch.exp(log_s + x.logprobs - x.logprobs.detach())  # value s_i, gradient s_i * grad logp_t
        pg, clipped = clipped_surrogate(ratio, x.advantages, cfg.clip_low, cfg.clip_high)

        if cfg.tis_cap is None:
            tis = torch.ones_like(log_s)
            truncated = torch.zeros_like(log_s)
        else:
            log_w = seq_mean((x.old_logprobs - x.rollout_logprobs).detach(), x)[x.seq_ids]
            tis = torch.exp(log_w).clamp(max=cfg.tis_cap)
            truncated = (log_w > float(np.log(cfg.tis_cap))).to(tis.dtype)
        metrics = {
            PG_CLIPFRAC: token_mean(clipped, x),
            PPO_KL: token_mean(-lr, x),
            TIS_WEIGHT_MEAN: token_mean(tis, x),
            TIS_CLIPFRAC: token_mean(truncated, x),
        }
        return finish_loss(pg * tis * sample_weights(x), x, cfg, metrics)


ALGORITHM = GSPO()
