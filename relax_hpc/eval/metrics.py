"""Evaluation metrics of one weights version: accuracy, unbiased pass@k, response length, per data source.

``eval/accuracy`` is the mean reward over every sample; ``eval/accuracy_thresholded`` the fraction of samples whose
reward is at least ``eval.threshold`` (correct samples); ``eval/pass@k`` the unbiased estimator of Chen et al. (2021)
averaged over prompts: with ``n`` samples of which ``c`` are correct, ``1 - C(n - c, k) / C(n, k)``;
``eval/response_length`` the mean generated tokens per sample (``eval/truncated_fraction``: samples cut at the token
limit). Where rows name a data source, ``eval/accuracy/<source>`` and ``eval/accuracy_thresholded/<source>`` too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptOutcome:
    """One held-out prompt's samples."""

    rewards: Sequence[float]
    lengths: Sequence[int]
    truncated: Sequence[bool]
    source: str | None = None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: ``n`` samples, ``c`` correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _source_name(source: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", source)[:64] or "_"


def summarize(outcomes: Sequence[PromptOutcome], *, threshold: float, pass_k: Sequence[int]) -> dict[str, float]:
    """The ``eval/*`` metrics of ``outcomes`` (module docstring)."""
    rewards = [r for o in outcomes for r in o.rewards]
    lengths = [n for o in outcomes for n in o.lengths]
    if not rewards:
        return {"eval/prompts": float(len(outcomes)), "eval/samples": 0.0}
    out = {"eval/accuracy": sum(rewards) / len(rewards),
           "eval/accuracy_thresholded": sum(r >= threshold for r in rewards) / len(rewards),
           "eval/response_length": sum(lengths) / len(lengths),
           "eval/response_length_max": float(max(lengths)),
           "eval/truncated_fraction": sum(t for o in outcomes for t in o.truncated) / len(rewards),
           "eval/prompts": float(len(outcomes)), "eval/samples": float(len(rewards))}
    for k in pass_k:
        vals = [pass_at_k(len(o.rewards), sum(r >= threshold for r in o.rewards), k) for o in outcomes if o.rewards]
        out[f"eval/pass@{k}"] = sum(vals) / len(vals)
    by_source: dict[str, list[float]] = {}
    for o in outcomes:
        if o.source is not None:
            by_source.setdefault(_source_name(o.source), []).extend(o.rewards)
    for name, rs in sorted(by_source.items()):
        if rs:
            out[f"eval/accuracy/{name}"] = sum(rs) / len(rs)
            out[f"eval/accuracy_thresholded/{name}"] = sum(r >= threshold for r in rs) / len(rs)
    return out
