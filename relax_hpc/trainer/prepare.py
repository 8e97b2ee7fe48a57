"""Turn a step's samples into train items: reward shaping, dynamic sampling, advantages, staleness weights."""

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
    """Apply the overlong penalty, drop zero-variance groups (dynamic sampling), compute advantages.

    Advantages are computed over the whole step's groups (a group's samples always travel together).
    """
    from relax_hpc.algorithms import common

    a = cfg.algorithm
    metrics: dict[str, float] = {}
    if not items:
        return Prepared([], {"rollout/num_samples": 0})
    rewards = np.array([it.reward for it in items], dtype=np.float32)
    metrics["rollout/reward"] = float(rewards.mean())
    metrics["rollout/reward_std"] = float(rewards.std())
    lengths = np.array([len(it.response_ids) for it in items])
    metrics["rollout/response_length"] = float(lengths.mean())
    metrics["rollout/response_length_max"] = float(lengths.max())
    if a.overlong.enabled:
        pen = common.overlong_penalty(lengths, cfg.rollout.sampling.max_new_tokens, a.overlong.buffer_tokens,
                                      a.overlong.penalty)
        rewards = rewards + pen.astype(np.float32)
        metrics["rollout/overlong_penalty_mean"] = float(pen.mean())
    groups = np.array([it.group_id for it in items])
    keep = np.ones(len(items), dtype=bool)
    if a.dynamic_sampling:
        keep = common.dynamic_sampling_mask(rewards, groups)
        metrics["rollout/dynamic_sampling_dropped"] = float((~keep).sum())
    adv = algorithm.sequence_advantages(rewards, groups, a)
    out = []
    for it, k, ad, r in zip(items, keep, adv, rewards):
        if not k:
            continue
        it.advantage = float(ad)
        it.reward = float(r)
        out.append(it)
    metrics["rollout/num_samples"] = float(len(out))
    metrics["rollout/advantage_abs_mean"] = float(np.abs(adv[keep]).mean()) if keep.any() else 0.0
    return Prepared(out, metrics)
