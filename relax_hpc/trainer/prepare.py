"""Turn a step's items into train items: advantages (with DAPO's overlong penalty and dynamic sampling) and the
step's reward metrics. The advantage pipeline itself is :func:`relax_hpc.algorithms.common.step_advantages`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.trainer.batch import TrainItem


@dataclass
class Prepared:
    items: list[TrainItem]
    metrics: dict[str, float] = field(default_factory=dict)


def prepare_items(items: list[TrainItem], cfg: RecipeConfig, algorithm: Any) -> Prepared:
    """Set every item's advantage and drop the samples dynamic sampling drops (whole zero-variance groups).

    Advantages are computed over the whole step's groups (a group's samples always travel together). ``reward``
    stays the task's reward (the overlong penalty only enters the advantages).
    """
    from relax_hpc.algorithms import common

    a = cfg.algorithm
    if not items:
        return Prepared([], {"rollout/num_samples": 0})
    rewards = np.array([it.sample.reward for it in items], dtype=np.float64)
    lengths = np.array([len(it.sample.response_ids) for it in items])
    groups = np.array([it.sample.group_id for it in items])
    max_new = cfg.rollout.sampling.max_new_tokens
    adv, keep = common.step_advantages(algorithm, rewards, groups, lengths, cfg=a, max_new_tokens=max_new)
    metrics = {"rollout/reward": float(rewards.mean()), "rollout/reward_std": float(rewards.std()),
               "rollout/response_length": float(lengths.mean()),
               "rollout/response_length_max": float(lengths.max()),
               "rollout/response_length_p50": float(np.percentile(lengths, 50)),
               "rollout/response_length_p99": float(np.percentile(lengths, 99)),
               "rollout/truncated_fraction": float((lengths >= max_new).mean())}
    if a.overlong.enabled:
        pen = common.overlong_penalty(lengths, max_new, a.overlong.buffer_tokens, a.overlong.penalty)
        metrics["rollout/overlong_penalty_mean"] = float(pen.mean())
    if a.dynamic_sampling:
        metrics["rollout/dynamic_sampling_dropped"] = float((~keep).sum())
    out = []
    for it, k, ad in zip(items, keep, adv):
        if k:
            it.advantage = float(ad)
            out.append(it)
    metrics["rollout/num_samples"] = float(len(out))
    metrics["rollout/advantage_abs_mean"] = float(np.abs(adv[keep]).mean()) if keep.any() else 0.0
    return Prepared(out, metrics)
