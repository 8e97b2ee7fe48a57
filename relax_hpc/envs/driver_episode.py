"""Multi-turn episodes inside the rollout driver: :class:`EnvEpisode` is the driver's :class:`Episode` for a recipe
with ``rollout.env``. Every prompt's group is ``n`` concurrent episodes (all groups of a batch run at once, so many
episodes are in flight and the engine batches their requests); each episode becomes one trajectory per sample
(several when the chat template is not prefix-preserving), carrying its own prompt tokens (the environment's first
messages with the tool section), the interleaved response, loss mask, per-token versions and turn boundaries.

Rewards come from the episodes (:meth:`EnvEpisode.score`, used by the driver instead of scoring decoded text); an
episode whose environment failed drops its group (``on_error: drop``) or scores 0. A weight update mid-turn comes
back as an aborted request and the turn continues with the new weights, unless the role is stopping.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.envs.episode import EpisodeStats, run_episode
from relax_hpc.envs.metrics import episode_metrics, stats_record
from relax_hpc.envs.registry import make_env
from relax_hpc.envs.rollout import EpisodeRunner, task_of
from relax_hpc.rollout.driver import Episode, EpisodeContext, Trajectory


class EnvEpisode(Episode):
    """The driver's episode for ``rollout.env``."""

    def __init__(self, cfg: RecipeConfig, tokenizer: Any):
        self.runner = EpisodeRunner(cfg, tokenizer)
        self.cfg = cfg
        self.stats: list[EpisodeStats] = []
        """Episodes of the current batch (their metrics are taken by :meth:`take_metrics`)."""

    async def run_group(self, ctx: EpisodeContext, prompt: Any) -> list[Trajectory]:
        r = self.runner
        env_cfg = r.env_cfg
        task = task_of(prompt)
        seed = ctx.sampling.seed if ctx.sampling.seed is not None else abs(hash(ctx.request_id)) % (1 << 31)
        sampling = dataclasses.replace(ctx.sampling, n=1, seed=None)
        eps = await asyncio.gather(*(run_episode(
            ctx.engine, make_env(env_cfg.name, env_cfg.kwargs), task, tokenizer=r.tokenizer, cfg=env_cfg,
            sampling=sampling, parser=r.parser, seed=seed + j, request_id=f"{ctx.request_id}/e{j}",
            scorer=r.scorer, resume=lambda: ctx.resume_aborted and not ctx.stopping)
            for j in range(ctx.sampling.n)))
        failed = any(e.stats.error is not None for e in eps)
        out = []
        for j, ep in enumerate(eps):
            self.stats.append(ep.stats)
            reward = 0.0 if ep.stats.error is not None else ep.stats.reward
            for k, s in enumerate(ep.samples):
                t = Trajectory(token_ids=s.response_ids, logprobs=s.logprobs, versions=s.versions,
                               loss_mask=s.loss_mask, finish_reason=s.finish_reason, prompt_ids=s.prompt_ids,
                               turns=s.turns)
                t.metadata = {"episode": j, "part": k, "reward": reward, "env_error": ep.stats.error,
                              "drop": failed and env_cfg.on_error == "drop",
                              "tool_calls": ep.stats.tool_calls, "truncated": ep.stats.truncated,
                              **({"agent": stats_record(ep.stats)} if k == 0 else {})}
                out.append(t)
        return out

    def score(self, prompts: Any, trajs: list[list[Trajectory]]) -> Any:
        """The episodes' rewards as the driver's reward result (no text is re-scored)."""
        from relax_hpc.rewards.runner import RewardResult

        flat = [t for g in trajs for t in g]
        rewards = np.asarray([t.metadata["reward"] for t in flat], dtype=np.float32)
        failed = np.asarray([t.metadata["env_error"] is not None for t in flat], dtype=bool)
        dropped = np.asarray([t.metadata["drop"] for t in flat], dtype=bool)
        return RewardResult(rewards, {}, failed, [t.metadata["env_error"] for t in flat], dropped,
                            {"reward/samples": len(flat), "reward/errors": int(failed.sum())})

    def take_metrics(self) -> dict[str, float]:
        """The ``agent/*`` metrics of the episodes since the last call."""
        stats, self.stats = self.stats, []
        return episode_metrics(stats)
