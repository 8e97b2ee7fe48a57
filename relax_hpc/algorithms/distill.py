"""On-policy distillation: the student samples, the teacher scores each sampled token, and the per-token reverse
KL becomes (part of) the advantage.

Per masked-in token, with the detached per-token reverse-KL estimate ``kl_t = old_logp_t - teacher_logp_t`` (a
one-sample estimate of KL(student || teacher) at that position, on the log-probs the ratio is taken against: the
rollout's, or the trainer's proximal ones with ``proximal``)::

    A_t = -distill.coef * kl_t + distill.reward_coef * A_i      (A_i: the GRPO group advantage of the sample)

then GRPO's clipped surrogate, TIS weight, KL and entropy terms on that ``A_t`` (``grpo.py``).

The split: :meth:`Distill.sequence_advantages` returns ``reward_coef * A_i`` (all zeros when ``reward_coef == 0``);
the trainer broadcasts it as ``LossInputs.advantages`` like for any algorithm, and :meth:`Distill.loss` adds the
per-token term from ``LossInputs.teacher_logprobs``, which it requires. ``dynamic_sampling`` filters on rewards only,
so it would drop useful groups of pure distillation: leave it off unless ``reward_coef > 0``. Dropped: the teacher's
full distribution (only the sampled token's log-prob is used), and any discount across positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from torch import Tensor

from relax_hpc.algorithms.base import LossInputs
from relax_hpc.algorithms.common import group_advantages, token_mean
from relax_hpc.algorithms.grpo import GRPO
from relax_hpc.config.algorithm import DistillAlgorithmConfig, own_options

if TYPE_CHECKING:
    from relax_hpc.config.schema import AlgorithmConfig

REVERSE_KL = "train/distill_reverse_kl"


class Distill(GRPO):
    """On-policy distillation with an optional task-reward term."""

    name = "distill"

    def sequence_advantages(self, rewards: np.ndarray, group_ids: np.ndarray, cfg: AlgorithmConfig) -> np.ndarray:
        """[N] float32 ``distill.reward_coef`` times the group advantage (zeros when the coefficient is 0)."""
        adv = group_advantages(rewards, group_ids, std_normalize=cfg.std_normalize)
        return (own_options(cfg, DistillAlgorithmConfig).distill.reward_coef * adv).astype(np.float32)

    def loss(self, x: LossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
        """GRPO's loss on ``x.advantages - coef * (old_logp - teacher_logp)``; adds ``train/distill_reverse_kl``."""
        if x.teacher_logprobs is None:
            raise ValueError("algorithm 'distill' needs teacher_logprobs; the trainer passed none")
        reverse_kl = (x.old_logprobs - x.teacher_logprobs).detach()
        coef = own_options(cfg, DistillAlgorithmConfig).distill.coef
        loss, metrics = self.clipped_loss(x, cfg, x.advantages - coef * reverse_kl)
        metrics[REVERSE_KL] = token_mean(reverse_kl, x)
        return loss, metrics


ALGORITHM = Distill()
