"""The ``agent/*`` metrics of a batch of episodes (logged with the step's metrics, shown by the monitor).

The rollout side logs them for the episodes it ran; each episode's first sample also carries its counts in its
metadata (``agent``, :func:`stats_record`), so a fully_async trainer logs them for the episodes it trained on
(:func:`stats_of_samples`) and the monitor, which reads the trainer's metrics, shows them in every mode."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from relax_hpc.envs.episode import EpisodeStats

METRIC_NAMES = ("agent/episodes", "agent/turns_per_episode", "agent/tool_calls_per_turn", "agent/tool_errors",
                "agent/tool_latency_s", "agent/truncated_outputs", "agent/truncated_episodes", "agent/env_errors",
                "agent/episode_reward", "agent/samples_per_episode", "agent/aborted_turns")


def episode_metrics(stats: Sequence[EpisodeStats]) -> dict[str, float]:
    """Means per episode (``turns_per_episode``, ``episode_reward`` ...), per turn (``tool_calls_per_turn``), per
    call (``tool_latency_s``) and counts (``tool_errors``, ``truncated_*``, ``env_errors``)."""
    n = len(stats)
    if not n:
        return {}
    turns = sum(s.turns for s in stats)
    calls = sum(s.tool_calls for s in stats)
    return {
        "agent/episodes": float(n),
        "agent/turns_per_episode": turns / n,
        "agent/tool_calls_per_turn": calls / max(turns, 1),
        "agent/tool_errors": float(sum(s.tool_errors for s in stats)),
        "agent/tool_latency_s": sum(s.tool_latency_s for s in stats) / max(calls, 1),
        "agent/truncated_outputs": float(sum(s.truncated_outputs for s in stats)),
        "agent/truncated_episodes": float(sum(s.truncated is not None for s in stats)),
        "agent/env_errors": float(sum(s.error is not None for s in stats)),
        "agent/episode_reward": sum(s.reward for s in stats) / n,
        "agent/samples_per_episode": sum(s.samples for s in stats) / n,
        "agent/aborted_turns": float(sum(s.aborted_turns for s in stats)),
    }


_FIELDS = {f.name: f.type for f in dataclasses.fields(EpisodeStats)}


def stats_record(stats: EpisodeStats) -> dict[str, Any]:
    """An episode's counts as the JSON-able ``agent`` metadata of its first sample."""
    return dataclasses.asdict(stats)


def stats_of_samples(metadata: Iterable[dict[str, Any]]) -> list[EpisodeStats]:
    """The episodes whose first samples have these metadata (samples without an ``agent`` record are skipped,
    unknown keys ignored)."""
    out = []
    for m in metadata:
        rec = m.get("agent") if isinstance(m, dict) else None
        if isinstance(rec, dict):
            out.append(EpisodeStats(**{k: v for k, v in rec.items() if k in _FIELDS}))
    return out
