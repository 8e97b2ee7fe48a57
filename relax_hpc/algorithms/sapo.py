"""SAPO (soft adaptive policy optimization): a smooth sigmoid gate on the token ratio instead of a hard clip.

Per masked-in token, with ``r_t = exp(logp_t - old_logp_t)`` and ``tau_t = sapo_tau_pos`` if ``A_t > 0`` else
``sapo_tau_neg``::

    f(r)  = (4 / tau) * sigmoid(tau * (r - 1))
    l_t   = -f(r_t) * A_t * w_t * sample_weight_t           (w_t: the truncated IS weight, as in GRPO)
    loss  = agg(l) + kl_coef * agg(kl) - entropy_coef * agg(entropy)

``d f / d r = 4 p (1 - p)`` with ``p = sigmoid(tau (r - 1))``: exactly 1 at ``r = 1``, so on-policy the gradient is
the plain policy gradient ``-A grad logp``, and it decays smoothly (like ``exp(-tau |r - 1|)``) as ``r`` leaves 1,
faster for the larger ``tau`` (negative advantages by default). The loss *value* at ``r = 1`` is ``-2 A / tau``, not
``-A``: only its gradient matches the plain objective. No hard clip; ``clip_low`` / ``clip_high`` are unused.

Advantages as GRPO's. The paper averages ``1/|y_i|`` per sequence (``loss_agg: seq_mean_token_mean``); any
``loss_agg`` works. Metrics as GRPO's, except ``train/pg_clipfrac``: the fraction of tokens whose gate weight
``4 p (1 - p)`` is below 1/2 (gradient more than halved), and ``train/sapo_gate_weight`` its token mean.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from relax_hpc.algorithms.base import PG_CLIPFRAC, PPO_KL, LossInputs
from relax_hpc.algorithms.common import finish_loss, log_ratio, sample_weights, token_mean, token_tis
from relax_hpc.algorithms.grpo import GRPO
from relax_hpc.config.algorithm import SAPOConfig, own_options

if TYPE_CHECKING:
    from relax_hpc.config.schema import AlgorithmConfig

GATE_WEIGHT = "train/sapo_gate_weight"


def gate_temperature(ratio: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """[T] ``tau_pos`` where ``A > 0``, else ``tau_neg``, in the dtype of ``ratio`` (never rounded to float32)."""
    return torch.where(advantages > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))


def soft_gate(ratio: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """[T] ``f(r) = (4 / tau) * sigmoid(tau * (r - 1))``, ``tau = tau_pos`` where ``A > 0``, else ``tau_neg``."""
    tau = gate_temperature(ratio, advantages, tau_pos, tau_neg)
    return (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))


class SAPO(GRPO):
    """Soft adaptive policy optimization."""

    name = "sapo"

    def loss(self, x: LossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
        """Soft-gated surrogate plus the KL and entropy terms (module docstring)."""
        lr = log_ratio(x)  # masked before the exponential
        ratio = torch.exp(lr)
        opts = own_options(cfg, SAPOConfig)  # the gate temperatures exist for algorithm.name: sapo only
        pg = -soft_gate(ratio, x.advantages, opts.sapo_tau_pos, opts.sapo_tau_neg) * x.advantages
        with torch.no_grad():
            tau = gate_temperature(ratio, x.advantages, opts.sapo_tau_pos, opts.sapo_tau_neg)
            p = torch.sigmoid(tau * (ratio.detach() - 1.0))
            gate_weight = 4.0 * p * (1.0 - p)
        tis, metrics = token_tis(x, cfg.tis_cap)
        metrics[PG_CLIPFRAC] = token_mean((gate_weight < 0.5).to(ratio.dtype), x)
        metrics[GATE_WEIGHT] = token_mean(gate_weight, x)
        metrics[PPO_KL] = token_mean(-lr, x)
        return finish_loss(pg * tis * sample_weights(x), x, cfg, metrics)


ALGORITHM = SAPO()
