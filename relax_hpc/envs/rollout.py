"""Episodes for the rollout driver: everything a recipe's ``rollout.env`` names, built once, and a group of
``n`` concurrent episodes per task (the engine batches their requests).

A group's episodes become training samples with the episode's reward; an episode whose environment failed drops
its whole group (``on_error: drop``, counted) or keeps what it has with reward 0 (``zero``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.envs.api import Task
from relax_hpc.envs.episode import EpisodeResult, Scorer, run_episode
from relax_hpc.envs.parsers import resolve_parser
from relax_hpc.envs.registry import make_env
from relax_hpc.rollout.engine import RolloutEngine, SamplingParams


@dataclass
class GroupResult:
    episodes: list[EpisodeResult]
    dropped: bool
    """An environment failed and ``on_error`` is ``drop``: train on none of the group."""


class EpisodeRunner:
    """Runs a recipe's episodes; one per rollout worker."""

    def __init__(self, cfg: RecipeConfig, tokenizer: Any):
        assert cfg.rollout.env is not None, "EpisodeRunner needs rollout.env"
        self.cfg = cfg
        self.env_cfg = cfg.rollout.env
        self.tokenizer = tokenizer
        self.parser = resolve_parser(self.env_cfg.tool_parser)
        s = cfg.rollout.sampling
        self.sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                       max_new_tokens=s.max_new_tokens, stop=tuple(s.stop))
        self.scorer: Scorer | None = self._scorer() if self.env_cfg.reward != "env" else None

    def _scorer(self) -> Scorer:
        from relax_hpc.rewards.runner import RewardRunner

        runner = RewardRunner(self.cfg.reward)

        async def score(answer: str, task: Task) -> float:
            res = await asyncio.to_thread(runner.score, [answer], [task.answer], [task.meta])
            return float(res.rewards[0])

        return score

    async def run_group(self, engine: RolloutEngine, task: Task, *, n: int, seed: int,
                        group_id: str) -> GroupResult:
        """``n`` episodes of ``task`` at once."""
        eps = await asyncio.gather(*(run_episode(
            engine, make_env(self.env_cfg.name, self.env_cfg.kwargs), task, tokenizer=self.tokenizer,
            cfg=self.env_cfg, sampling=self.sampling, parser=self.parser, seed=seed * 1_000_003 + j,
            request_id=f"{group_id}-{j}", scorer=self.scorer) for j in range(n)))
        failed = any(e.stats.error is not None for e in eps)
        if failed and self.env_cfg.on_error == "zero":
            for e in eps:
                if e.stats.error is not None:
                    e.stats.reward = 0.0
        return GroupResult(list(eps), failed and self.env_cfg.on_error == "drop")


def store_group(group: GroupResult, group_id: str) -> Any:
    """The group's samples as a store :class:`~relax_hpc.store.sample.SampleGroup`: every sample of every episode
    (an episode may hold several when the template is not prefix-preserving) with the episode's reward. A sample's
    ``version`` is its oldest generated token's (staleness is counted from it), ``version_last`` its newest."""
    from relax_hpc.envs.metrics import stats_record
    from relax_hpc.store.sample import Sample, SampleGroup

    samples = []
    for j, ep in enumerate(group.episodes):
        for k, s in enumerate(ep.samples):
            gen = s.versions[s.loss_mask.astype(bool)]
            samples.append(Sample(
                prompt_ids=s.prompt_ids, response_ids=s.response_ids, logprobs=s.logprobs,
                reward=float(ep.stats.reward), loss_mask=s.loss_mask,
                version=int(gen.min()) if len(gen) else 0, version_first=int(gen.min()) if len(gen) else 0,
                version_last=int(gen.max()) if len(gen) else 0,
                rewards={"env": float(ep.stats.env_reward), "function": float(ep.stats.function_reward)},
                turns=s.turns,
                metadata={"episode": j, "part": k, "finish_reason": s.finish_reason,
                          "truncated": ep.stats.truncated, "tool_calls": ep.stats.tool_calls,
                          **({"agent": stats_record(ep.stats)} if k == 0 else {})}))
    return SampleGroup(group_id, samples)


def task_of(prompt: Any) -> Task:
    """The environment's task for a data prompt (:class:`relax_hpc.data.dataset.Prompt`)."""
    return Task(prompt=prompt.raw, answer=prompt.answer, meta=dict(prompt.meta))
