"""The interface between the trainer and an algorithm: :class:`LossInputs` in, a scalar loss and metrics out.

One micro-batch is *packed and ragged*: its ``S`` sequences' response tokens are concatenated into ``T`` tokens, and
``seq_ids[t]`` says which sequence token ``t`` belongs to. Prompt tokens never appear here.

Normalisation. ``loss`` returns the micro-batch's share of the *step* loss: every sum is divided by a normaliser of
the whole step (all micro-batches of all data-parallel ranks), ``global_num_tokens`` or ``global_num_seqs``. So the
sum of the micro-batch losses over gradient accumulation and ranks equals the loss of one big batch, and gradients are
summed, never averaged, across micro-batches and ranks (the trainer all-reduces with SUM, or averages and multiplies
by the world size). Metrics are normalised the same way and are summed the same way.
A trainer that streams micro-batches learns the normalisers only at the end of the step: it may back-propagate each
micro-batch's loss with both normalisers 1 and divide the summed gradient by the ``loss_agg`` normaliser afterwards,
which is exact because every loss term is an ``aggregate(..., cfg.loss_agg)`` (an algorithm must keep it so; the
torch trainer checks). Metrics have their own normalisers (token means divide by tokens whatever ``loss_agg`` is), so
the trainer computes them from each micro-batch's detached inputs with the true normalisers.
:func:`relax_hpc.algorithms.common.count_normalisers` counts one micro-batch's share of both normalisers.

Three log-probs, two policies (decoupled PPO).

* ``rollout_logprobs``: recorded by the rollout engine, the behaviour policy that sampled the tokens.
* ``old_logprobs``: the policy the ratio ``exp(logprobs - old_logprobs)`` is taken against and clipped around.
  With ``cfg.proximal`` the trainer recomputes them with its own weights before the update (the proximal policy);
  otherwise it passes ``rollout_logprobs`` again.
* The truncated importance weight ``min(exp(old_logprobs - rollout_logprobs), cfg.tis_cap)`` (detached) corrects the
  gap between the two. Without ``proximal`` the two are the same tensor, so the weight is 1 (for ``tis_cap >= 1``)
  and the objective is plain PPO clipped around the behaviour policy; with ``proximal`` it is the decoupled objective
  ``w_t * clipped(pi / pi_prox)`` of Hilton et al. with the behaviour ratio truncated at the cap.
  ``cfg.tis_cap = None`` sets the weight to 1 in both cases.

Advantages. :meth:`Algorithm.sequence_advantages` turns the scalar rewards of a step into one advantage per sample
(:func:`relax_hpc.algorithms.common.step_advantages` applies DAPO's overlong penalty and dynamic sampling around it);
the trainer broadcasts each to its sample's response tokens as ``LossInputs.advantages``. An algorithm may add a
per-token term inside ``loss`` (``distill`` does, from ``teacher_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from relax_hpc.config.schema import AlgorithmConfig

# Metric keys (the names Relax/slime use where one exists).
PG_LOSS = "train/pg_loss"
PG_CLIPFRAC = "train/pg_clipfrac"
PPO_KL = "train/ppo_kl"
KL_LOSS = "train/kl_loss"
ENTROPY_LOSS = "train/entropy_loss"
TIS_WEIGHT_MEAN = "train/tis_weight_mean"
TIS_CLIPFRAC = "train/tis_clipfrac"


_PER_TOKEN = ("logprobs", "old_logprobs", "rollout_logprobs", "advantages", "loss_mask", "entropy", "ref_logprobs",
              "teacher_logprobs", "sample_weights")
"""The float fields of :class:`LossInputs` with one value per token (``seq_ids`` besides them)."""


@dataclass
class LossInputs:
    """One packed micro-batch of response tokens. ``T`` = its response tokens, ``S`` = its sequences."""

    logprobs: Tensor
    """[T] log-probs of the sampled tokens under the current policy (requires grad)."""
    old_logprobs: Tensor
    """[T] log-probs the ratio is taken against: the trainer's recomputed proximal policy when ``cfg.proximal``,
    else the same values as ``rollout_logprobs``."""
    rollout_logprobs: Tensor
    """[T] log-probs recorded by the rollout engine (behaviour policy)."""
    advantages: Tensor
    """[T] per-token advantages (each sample's sequence advantage broadcast to its tokens)."""
    loss_mask: Tensor
    """[T] float 0/1: 0 for tool/environment tokens and for dropped samples."""
    seq_ids: Tensor
    """[T] long in ``[0, S)``: the sequence each token belongs to."""
    num_seqs: int
    """``S``: sequences in this micro-batch."""
    global_num_tokens: float
    """Tokens with ``loss_mask == 1`` in the whole step (all micro-batches, all ranks): the ``token_mean`` normaliser.
    A step without any (0) gives a loss of 0."""
    global_num_seqs: float
    """Sequences in the whole step that have at least one masked-in token: the ``seq_mean_*`` normaliser."""
    max_response_tokens: int
    """Constant per-sequence normaliser of ``seq_mean_token_sum_norm`` (Dr.GRPO), normally ``max_new_tokens``."""
    entropy: Tensor | None = None
    """[T] entropy of the current policy at each position (needed when ``cfg.entropy_coef != 0``)."""
    ref_logprobs: Tensor | None = None
    """[T] log-probs under the reference model (needed when ``cfg.kl_coef > 0``)."""
    teacher_logprobs: Tensor | None = None
    """[T] log-probs under the teacher (needed by ``distill``)."""
    sample_weights: Tensor | None = None
    """[T] extra per-token weights of the policy-gradient term (e.g. staleness re-weighting); ``None`` = 1."""

    def __post_init__(self) -> None:
        (t,) = self.logprobs.shape
        for name in (*_PER_TOKEN[1:], "seq_ids"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (t,):
                raise ValueError(f"LossInputs.{name} has shape {tuple(value.shape)}, expected ({t},) like logprobs")
        if self.seq_ids.dtype != torch.long:
            raise ValueError(f"LossInputs.seq_ids must be torch.long, got {self.seq_ids.dtype}")
        if self.max_response_tokens < 1:
            raise ValueError(f"LossInputs.max_response_tokens must be >= 1, got {self.max_response_tokens}")


def concat_inputs(xs: list[LossInputs]) -> LossInputs:
    """The micro-batches ``xs`` (same step, same normalisers) as one: tokens concatenated, sequence ids offset.
    Every loss term and metric is a sum over tokens or sequences divided by the step's normalisers, so one loss call
    over the result gives the sum of the calls over ``xs`` (up to float summation order). Missing
    ``sample_weights`` count as 1; any other optional field must be set in all or none."""
    if len(xs) == 1:
        return xs[0]
    fields: dict[str, Tensor | None] = {}
    for name in _PER_TOKEN:
        vals = [getattr(x, name) for x in xs]
        if name == "sample_weights" and any(v is not None for v in vals):
            vals = [torch.ones_like(x.logprobs) if v is None else v for x, v in zip(xs, vals, strict=True)]
        if all(v is None for v in vals):
            fields[name] = None
        elif any(v is None for v in vals):
            raise ValueError(f"concat_inputs: LossInputs.{name} is set in some micro-batches only")
        else:
            fields[name] = torch.cat(vals)  # type: ignore[arg-type]
    offsets = np.cumsum([0] + [x.num_seqs for x in xs[:-1]])
    seq_ids = torch.cat([x.seq_ids + int(o) for x, o in zip(xs, offsets, strict=True)])
    first = xs[0]
    return LossInputs(**fields, seq_ids=seq_ids, num_seqs=sum(x.num_seqs for x in xs),  # type: ignore[arg-type]
                      global_num_tokens=first.global_num_tokens, global_num_seqs=first.global_num_seqs,
                      max_response_tokens=first.max_response_tokens)


@runtime_checkable
class Algorithm(Protocol):
    """What the trainer calls. A module of the registry exposes one as ``ALGORITHM``."""

    name: str
    """Registry name (used in logs)."""

    def sequence_advantages(self, rewards: np.ndarray, group_ids: np.ndarray, cfg: AlgorithmConfig) -> np.ndarray:
        """[N] float32 advantages of N samples from their [N] scalar rewards and [N] group labels."""
        ...

    def loss(self, x: LossInputs, cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
        """This micro-batch's scalar loss, already divided by the step's normaliser, and detached scalar metrics
        (keys above) normalised the same way, so that both sum over micro-batches and ranks."""
        ...
