"""Train/rollout mismatch: how far the rollout engine's sampling log-probs are from the trainer's recomputed
log-probs of the same tokens.

Per masked-in response token ``t`` with ``d_t = logp_trainer_t - logp_rollout_t`` (the trainer's log-prob at the
sampling temperature, before the step's update, minus the one the engine recorded while sampling):

* ``train/mismatch_kl``: the k3 estimator of ``KL(rollout || trainer)``, mean over tokens of ``exp(d) - 1 - d``
  (non-negative per token, unbiased under the rollout's samples);
* ``train/logprob_abs_diff_mean`` and ``train/logprob_abs_diff_max``: mean and max of ``|d|``;
* ``train/logprob_diff_frac_gt_0.5``: the fraction of tokens with ``|d| > 0.5``;
* ``train/mismatch_tis_clipfrac``: the fraction of tokens whose importance weight ``exp(d)`` exceeds
  ``algorithm.tis_cap`` (what truncated importance sampling would clip; 0 without a cap).

In colocate the engine generates with the trainer's own module, so every figure measures numerics only (batching,
the decode kernels, the dtype); in fully_async a sample generated ``s`` versions before the trainer's weights also
carries the policy change of ``s`` updates, so each metric is also given per staleness bucket
(``train/mismatch_kl/staleness_0``, ``..._1``, ``..._2plus``): the ``staleness_0`` figures isolate the numerics (and a
broken weight sync, which :mod:`relax_hpc.health` alerts on).

:class:`MismatchMeter` accumulates the sums over a step's micro-batches; the sums have fixed keys (every bucket on
every rank) so that data-parallel ranks can add them; :func:`mismatch_metrics` turns reduced sums into the metrics.
"""

from __future__ import annotations

import math
from typing import Any

KL = "train/mismatch_kl"
ABS_MEAN = "train/logprob_abs_diff_mean"
ABS_MAX = "train/logprob_abs_diff_max"
FRAC_BIG = "train/logprob_diff_frac_gt_0.5"
TIS_CLIP = "train/mismatch_tis_clipfrac"
BIG_DIFF = 0.5
"""``|d|`` above this counts in ``FRAC_BIG``."""
BUCKETS = ("0", "1", "2plus")
"""Staleness buckets (versions the sample lags the trainer's weights)."""
_SUMS = ("tokens", "k3", "abs", "big", "clip")
_PREFIX = "mismatch_sum/"


def bucket_of(staleness: int) -> str:
    return BUCKETS[min(max(int(staleness), 0), len(BUCKETS) - 1)]


def token_sums(diff: Any, mask: Any, *, tis_cap: float | None) -> dict[str, float]:
    """The sums of one set of tokens (torch tensors ``diff`` and 0/1 ``mask`` of the same shape)."""
    import torch

    on = mask > 0
    d = diff[on].double()
    if not d.numel():
        return dict.fromkeys((*_SUMS, "max"), 0.0)
    a = d.abs()
    clip = (d > math.log(tis_cap)).sum() if tis_cap is not None else torch.zeros((), dtype=torch.long)
    vals = torch.stack([torch.tensor(float(d.numel()), dtype=torch.float64, device=d.device),
                        (torch.expm1(d) - d).sum(), a.sum(), (a > BIG_DIFF).sum().double(), clip.double(), a.max()])
    return dict(zip((*_SUMS, "max"), vals.tolist(), strict=True))


class MismatchMeter:
    """The mismatch sums of one training step, by staleness bucket."""

    def __init__(self, tis_cap: float | None):
        self.tis_cap = tis_cap
        self.reset()

    def reset(self) -> None:
        self._sums = {b: dict.fromkeys(_SUMS, 0.0) for b in BUCKETS}
        self._max = {b: 0.0 for b in BUCKETS}

    def add(self, trainer_logprobs: Any, rollout_logprobs: Any, loss_mask: Any, seq_ids: Any,
            seq_staleness: list[int]) -> None:
        """One micro-batch: per-token log-probs [T] (detached), its loss mask and sequence ids, and each sequence's
        staleness (trainer version minus the sample's version)."""
        import torch

        diff = trainer_logprobs.detach().float() - rollout_logprobs.float()
        per_seq = [bucket_of(s) for s in seq_staleness]
        if all(b == "0" for b in per_seq):  # colocate, and most fully_async steps: one bucket, no selection
            self._add("0", token_sums(diff, loss_mask, tis_cap=self.tis_cap))
            return
        for b in sorted(set(per_seq)):
            sel = torch.tensor([p == b for p in per_seq], device=diff.device)[seq_ids]
            self._add(b, token_sums(diff, loss_mask * sel.to(loss_mask.dtype), tis_cap=self.tis_cap))

    def _add(self, bucket: str, s: dict[str, float]) -> None:
        for k in _SUMS:
            self._sums[bucket][k] += s[k]
        self._max[bucket] = max(self._max[bucket], s["max"])

    def sums(self) -> dict[str, float]:
        """Flat sums with fixed keys (every bucket), to be added over data-parallel ranks."""
        return {f"{_PREFIX}{b}/{k}": v for b, d in self._sums.items() for k, v in d.items()}

    def maxima(self, world_size: int = 1) -> dict[str, float]:
        """The largest ``|d|`` per bucket, over data-parallel ranks (a MAX all-reduce when there are several)."""
        vals = [self._max[b] for b in BUCKETS]
        if world_size > 1:
            import torch
            import torch.distributed as dist

            if dist.is_initialized():
                backend = dist.get_backend()
                dev = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
                t = torch.tensor(vals, dtype=torch.float64, device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                vals = t.tolist()
        return dict(zip(BUCKETS, vals, strict=True))


def mismatch_metrics(reduced: dict[str, float], maxima: dict[str, float]) -> dict[str, float]:
    """Pop the mismatch sums out of ``reduced`` (summed over ranks) and return the metrics: overall (always, 0 for
    a step without tokens), and per staleness bucket where a bucket other than ``0`` has tokens."""
    sums = {b: {k: float(reduced.pop(f"{_PREFIX}{b}/{k}", 0.0)) for k in _SUMS} for b in BUCKETS}
    total = {k: sum(sums[b][k] for b in BUCKETS) for k in _SUMS}
    out = _means(total, max(maxima.values(), default=0.0), "") or dict.fromkeys(
        (KL, ABS_MEAN, ABS_MAX, FRAC_BIG, TIS_CLIP), 0.0)  # every key every step (a rank without items too)
    filled = [b for b in BUCKETS if sums[b]["tokens"] > 0]
    if len(filled) > 1 or (filled and filled != ["0"]):
        for b in filled:
            out.update(_means(sums[b], maxima[b], f"/staleness_{b}"))
    return out


def _means(s: dict[str, float], mx: float, suffix: str) -> dict[str, float]:
    n = s["tokens"]
    if n <= 0:
        return {}
    return {KL + suffix: s["k3"] / n, ABS_MEAN + suffix: s["abs"] / n, ABS_MAX + suffix: mx,
            FRAC_BIG + suffix: s["big"] / n, TIS_CLIP + suffix: s["clip"] / n}


def staleness_of(items: list[Any], trainer_version: int) -> list[int]:
    """Each item's staleness: the trainer's weight version minus the version that generated it."""
    return [max(trainer_version - int(it.sample.version), 0) for it in items]
