"""Pieces shared by the algorithms.

Per step, on scalar rewards (numpy): group advantages (GRPO / Dr.GRPO), DAPO's dynamic-sampling mask and soft overlong
penalty, and :func:`step_advantages`, which applies them in order. Per micro-batch (torch): the four ``loss_agg``
reductions, the KL estimators, truncated importance weights, the clipped surrogate, and :func:`finish_loss`, which
adds the KL and entropy terms and fills the common metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from relax_hpc.algorithms.base import (
    ENTROPY_LOSS,
    KL_LOSS,
    PG_LOSS,
    TIS_CLIPFRAC,
    TIS_WEIGHT_MEAN,
    Algorithm,
    LossInputs,
)

if TYPE_CHECKING:
    from relax_hpc.config.schema import AlgorithmConfig


# ------------------------------------------------------------------------------------------------ rewards (numpy)
def _groups(rewards: np.ndarray, group_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rewards as float64 [N] and each sample's group as an index in ``[0, G)``."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    g = np.asarray(group_ids).reshape(-1)
    if r.shape != g.shape:
        raise ValueError(f"rewards {r.shape} and group_ids {g.shape} differ in length")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards must be finite (NaN/inf rewards are handled by reward.on_error before this)")
    _, inverse = np.unique(g, return_inverse=True)
    return r, inverse.reshape(-1)


def group_advantages(rewards: np.ndarray, group_ids: np.ndarray, std_normalize: bool, eps: float = 1e-6) -> np.ndarray:
    """[N] float32 group-relative advantages.

    ``std_normalize=True`` (GRPO): ``(r - mean_g) / (std_g + eps)``; ``False`` (Dr.GRPO): ``r - mean_g``. ``std_g`` is
    the *population* std of the group (divide by G, not G - 1). A group of one sample, or whose rewards are all equal,
    gets exactly 0. ``group_ids`` are any labels (need not be contiguous or sorted).
    """
    r, inv = _groups(rewards, group_ids)
    if r.size == 0:
        return np.zeros(0, dtype=np.float32)
    counts = np.bincount(inv)
    gmin = np.full(counts.size, np.inf)
    np.minimum.at(gmin, inv, r)
    shifted = r - gmin[inv]  # exactly 0 for equal rewards, so equal rewards give exactly 0 advantage
    centred = shifted - (np.bincount(inv, weights=shifted) / counts)[inv]
    if not std_normalize:
        return centred.astype(np.float32)
    std = np.sqrt(np.bincount(inv, weights=centred**2) / counts)
    return (centred / (std[inv] + eps)).astype(np.float32)


def dynamic_sampling_mask(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """[N] bool: True for samples whose group's rewards are not all equal (DAPO dynamic sampling keeps those).

    A group of one sample has zero variance and is dropped.
    """
    r, inv = _groups(rewards, group_ids)
    if r.size == 0:
        return np.zeros(0, dtype=bool)
    num_groups = int(inv.max()) + 1
    gmin = np.full(num_groups, np.inf)
    gmax = np.full(num_groups, -np.inf)
    np.minimum.at(gmin, inv, r)
    np.maximum.at(gmax, inv, r)
    return (gmax > gmin)[inv]


def overlong_penalty(
    response_lengths: np.ndarray, max_new_tokens: int, buffer_tokens: int, penalty: float
) -> np.ndarray:
    """[N] float32 DAPO soft overlong punishment, to be added to the rewards.

    With ``start = max_new_tokens - buffer_tokens``: 0 for ``len <= start``, then linear down to ``-penalty`` at
    ``len == max_new_tokens``, and ``-penalty`` beyond.
    """
    if buffer_tokens < 1:
        raise ValueError(f"overlong buffer_tokens must be >= 1, got {buffer_tokens}")
    lengths = np.asarray(response_lengths, dtype=np.float64).reshape(-1)
    start = max_new_tokens - buffer_tokens
    return (-penalty * np.clip((lengths - start) / buffer_tokens, 0.0, 1.0)).astype(np.float32)


def step_advantages(
    algorithm: Algorithm,
    rewards: np.ndarray,
    group_ids: np.ndarray,
    response_lengths: np.ndarray,
    *,
    cfg: AlgorithmConfig,
    max_new_tokens: int,
) -> tuple[np.ndarray, np.ndarray]:
    """([N] float32 advantages, [N] bool keep) of one step's samples, in DAPO's order.

    1. ``cfg.overlong.enabled``: the soft overlong penalty is added to the rewards.
    2. ``cfg.dynamic_sampling``: ``keep`` is False for groups whose (penalised) rewards are all equal; the trainer
       drops those samples (loss_mask 0, not counted in the normalisers). Otherwise all True.
    3. ``algorithm.sequence_advantages`` of the (penalised) rewards.
    """
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if cfg.overlong.enabled:
        o = cfg.overlong
        r = r + overlong_penalty(response_lengths, max_new_tokens, o.buffer_tokens, o.penalty)
    keep = dynamic_sampling_mask(r, group_ids) if cfg.dynamic_sampling else np.ones(r.shape, dtype=bool)
    adv = np.asarray(algorithm.sequence_advantages(r, np.asarray(group_ids), cfg), dtype=np.float32)
    return adv, keep


# ------------------------------------------------------------------------------------------------ aggregation (torch)
def count_normalisers(loss_mask: Tensor, seq_ids: Tensor, num_seqs: int) -> tuple[float, float]:
    """(masked-in tokens, sequences with at least one masked-in token) of one micro-batch. The trainer sums both
    over its micro-batches and all-reduces them over ranks to get ``global_num_tokens`` and ``global_num_seqs``."""
    per_seq = loss_mask.new_zeros(num_seqs).index_add(0, seq_ids, loss_mask)
    return float(loss_mask.sum()), float((per_seq > 0).sum())


def seq_sum(values: Tensor, x: LossInputs) -> Tensor:
    """[S] sum of [T] ``values`` per sequence (all tokens; multiply by the mask first to sum masked-in ones)."""
    return values.new_zeros(x.num_seqs).index_add(0, x.seq_ids, values)


def masked(values: Tensor, x: LossInputs) -> Tensor:
    """``values * loss_mask``, with masked-out positions exactly 0 even where ``values`` is inf or NaN there."""
    return torch.where(x.loss_mask > 0, values * x.loss_mask, values.new_zeros(()))


def log_ratio(x: LossInputs) -> Tensor:
    """[T] ``logprobs - old_logprobs`` on masked-in tokens, 0 elsewhere: masked before any exponential, so a
    ``-inf`` log-prob on a masked-out token (a tool token nobody sampled) gives neither ``inf`` nor a NaN gradient."""
    return torch.where(x.loss_mask > 0, x.logprobs - x.old_logprobs, x.logprobs.new_zeros(()))


def _norm(n: float) -> float:
    return max(float(n), 1.0)  # normalisers count tokens/sequences: an empty step has sum 0 and gives 0


def _token_mean(v: Tensor, x: LossInputs) -> Tensor:
    return masked(v, x).sum() / _norm(x.global_num_tokens)


def _seq_mean_token_mean(v: Tensor, x: LossInputs) -> Tensor:
    per_seq = seq_sum(masked(v, x), x) / seq_sum(x.loss_mask.to(v.dtype), x).clamp_min(1.0)
    return per_seq.sum() / _norm(x.global_num_seqs)


def _seq_mean_token_sum(v: Tensor, x: LossInputs) -> Tensor:
    return masked(v, x).sum() / _norm(x.global_num_seqs)


def _seq_mean_token_sum_norm(v: Tensor, x: LossInputs) -> Tensor:
    return masked(v, x).sum() / x.max_response_tokens / _norm(x.global_num_seqs)


AGGREGATORS: dict[str, Callable[[Tensor, LossInputs], Tensor]] = {
    "token_mean": _token_mean,
    "seq_mean_token_mean": _seq_mean_token_mean,
    "seq_mean_token_sum": _seq_mean_token_sum,
    "seq_mean_token_sum_norm": _seq_mean_token_sum_norm,
}


def aggregate(per_token: Tensor, x: LossInputs, mode: str) -> Tensor:
    """Scalar reduction of [T] ``per_token`` over masked-in tokens, on the step's global normaliser.

    * ``token_mean``: sum over tokens / ``global_num_tokens``.
    * ``seq_mean_token_mean``: per sequence, the mean over its tokens; summed / ``global_num_seqs``.
    * ``seq_mean_token_sum``: per sequence, the sum over its tokens; summed / ``global_num_seqs``.
    * ``seq_mean_token_sum_norm``: per sequence, the sum / ``max_response_tokens``; summed / ``global_num_seqs``
      (Dr.GRPO).
    """
    try:
        fn = AGGREGATORS[mode]
    except KeyError:
        raise ValueError(f"unknown loss_agg {mode!r}; valid: {', '.join(AGGREGATORS)}") from None
    return fn(per_token, x)


def token_mean(values: Tensor, x: LossInputs) -> Tensor:
    """Detached ``token_mean`` of ``values``: the form of every rate/mean metric (sums over micro-batches)."""
    return _token_mean(values.detach(), x)


# ------------------------------------------------------------------------------------------------ loss terms (torch)
def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kl_type: str) -> Tensor:
    """[T] per-token estimate of KL(pi || pi_ref) on tokens sampled from pi, with ``log r = ref_logprobs - logprobs``.

    * ``k1 = -log r = logprobs - ref_logprobs`` (unbiased, can be negative);
    * ``k2 = (log r)^2 / 2`` (biased, >= 0);
    * ``k3 = r - 1 - log r`` (unbiased, >= 0; ``log r`` is clamped to [-20, 20] to keep ``exp`` finite).
    """
    log_r = ref_logprobs - logprobs
    if kl_type == "k1":
        return -log_r
    if kl_type == "k2":
        return 0.5 * log_r.square()
    if kl_type == "k3":
        log_r = log_r.clamp(-20.0, 20.0)
        return torch.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown kl_type {kl_type!r}; valid: k1, k2, k3")


def tis_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float | None) -> Tensor:
    """[T] detached truncated importance weights ``min(exp(old - rollout), cap)``; ones when ``cap`` is None."""
    if cap is None:
        return torch.ones_like(old_logprobs).detach()
    if cap <= 0:
        raise ValueError(f"tis_cap must be > 0 (or None), got {cap}")
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=cap).detach()


def token_tis(x: LossInputs, cap: float | None) -> tuple[Tensor, dict[str, Tensor]]:
    """Token-level TIS weights and their metrics (mean weight, fraction of tokens truncated at the cap)."""
    w = tis_weights(x.old_logprobs, x.rollout_logprobs, cap)
    if cap is None:
        truncated = torch.zeros_like(w)
    else:
        truncated = ((x.old_logprobs - x.rollout_logprobs).detach() > float(np.log(cap))).to(w.dtype)
    return w, {TIS_WEIGHT_MEAN: token_mean(w, x), TIS_CLIPFRAC: token_mean(truncated, x)}


def clipped_surrogate(ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """([T] loss ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``, [T] float 1 where the clipped term is the
    smaller objective, i.e. where the clip removed the token's gradient)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).to(ratio.dtype).detach()


def finish_loss(
    pg_per_token: Tensor, x: LossInputs, cfg: AlgorithmConfig, metrics: dict[str, Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """``aggregate(pg) + kl_coef * aggregate(kl) - entropy_coef * aggregate(entropy)``, all with ``cfg.loss_agg``.

    Adds ``train/pg_loss`` and, when their inputs are given, ``train/kl_loss`` and ``train/entropy_loss`` (the
    aggregated terms before their coefficients) to ``metrics``. A coefficient without its input is a ValueError.
    """
    pg = aggregate(pg_per_token, x, cfg.loss_agg)
    loss = pg
    metrics[PG_LOSS] = pg.detach()
    if x.ref_logprobs is not None:
        kl = aggregate(kl_penalty(x.logprobs, x.ref_logprobs, cfg.kl_type), x, cfg.loss_agg)
        metrics[KL_LOSS] = kl.detach()
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    elif cfg.kl_coef > 0:
        raise ValueError("algorithm.kl_coef > 0 but the trainer passed no ref_logprobs")
    if x.entropy is not None:
        ent = aggregate(x.entropy, x, cfg.loss_agg)
        metrics[ENTROPY_LOSS] = ent.detach()
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * ent
    elif cfg.entropy_coef != 0:
        raise ValueError("algorithm.entropy_coef != 0 but the trainer passed no entropy")
    return loss, metrics


def sample_weights(x: LossInputs) -> Tensor | float:
    """[T] ``x.sample_weights`` (detached), or 1."""
    return 1.0 if x.sample_weights is None else x.sample_weights.detach()
