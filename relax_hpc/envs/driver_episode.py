"""Multi-turn episodes inside the rollout driver: :class:`EnvEpisode` is the driver's :class:`Episode` for a recipe
with ``rollout.env``, the one path multi-turn episodes run through. Every prompt's group is ``n`` concurrent
episodes (all groups of a batch run at once, so many episodes are in flight and the engine batches their requests);
each episode becomes one sample per part (several when the chat template is not prefix-preserving), carrying its own
prompt tokens (the environment's first messages with the tool section), the interleaved response, loss mask,
per-token versions and turn boundaries.

The episode's reward is each of its samples' ``reward`` (its parts ``env`` and ``function`` in ``rewards``), set
here; :meth:`EnvEpisode.score` hands them to the driver instead of scoring decoded text. An episode whose environment
failed drops its group (``on_error: drop``) or scores 0 (``zero``). A weight update mid-turn comes back as an aborted
request and the turn continues with the new weights (the driver's abort-and-resubmit loop), unless the role is
stopping. Episode ``j`` of a prompt gets the environment seed :meth:`EpisodeContext.seed` ``(j)``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.envs.api import Task, task_of
from relax_hpc.envs.episode import EpisodeResult, EpisodeStats, Scorer, play
from relax_hpc.envs.metrics import episode_metrics, stats_record
from relax_hpc.envs.parsers import resolve_parser
from relax_hpc.envs.registry import make_env
from relax_hpc.record import Sample
from relax_hpc.rollout.driver import Episode, EpisodeContext

if TYPE_CHECKING:
    from relax_hpc.data.dataset import Prompt
    from relax_hpc.rewards.runner import RewardResult


class EnvEpisode(Episode):
    """The driver's episode for ``rollout.env``."""

    def __init__(self, cfg: RecipeConfig, tokenizer: Any):
        assert cfg.rollout.env is not None, "EnvEpisode needs rollout.env"
        self.cfg = cfg
        self.env_cfg = cfg.rollout.env
        self.tokenizer = tokenizer
        self.parser = resolve_parser(self.env_cfg.tool_parser)
        self.scorer: Scorer | None = self._scorer() if self.env_cfg.reward != "env" else None
        self.stats: list[EpisodeStats] = []
        """Episodes of the current batch (their metrics are taken by :meth:`take_metrics`)."""

    def _scorer(self) -> Scorer:
        from relax_hpc.rewards.runner import RewardRunner

        runner = RewardRunner(self.cfg.reward)

        async def score(answer: str, task: Task) -> float:
            res = await asyncio.to_thread(runner.score, [answer], [task.answer], [task.meta])
            return float(res.rewards[0])

        return score

    async def run_group(self, ctx: EpisodeContext, prompt: Prompt) -> list[Sample]:
        env_cfg = self.env_cfg
        task = task_of(prompt)
        eps = await asyncio.gather(*(play(
            ctx, make_env(env_cfg.name, env_cfg.kwargs), task, tokenizer=self.tokenizer, cfg=env_cfg,
            parser=self.parser, seed=ctx.seed(j), scorer=self.scorer, name=f"e{j}") for j in range(ctx.sampling.n)))
        drop = env_cfg.on_error == "drop" and any(e.stats.error is not None for e in eps)
        out = []
        for j, ep in enumerate(eps):
            self.stats.append(ep.stats)
            out += samples_of(ep, j, drop=drop)
        return out

    def score(self, prompts: Sequence[Prompt], groups: list[list[Sample]]) -> RewardResult:
        """The episodes' rewards (each sample's ``reward``) as the driver's reward result: no text is re-scored."""
        from relax_hpc.rewards.runner import RewardResult

        flat = [t for g in groups for t in g]
        rewards = np.asarray([t.reward for t in flat], dtype=np.float32)
        reasons = [t.metadata["env_error"] for t in flat]
        failed = np.asarray([r is not None for r in reasons], dtype=bool)
        dropped = np.asarray([t.metadata["drop"] for t in flat], dtype=bool)
        return RewardResult(rewards, {}, failed, reasons, dropped,
                            {"reward/samples": len(flat), "reward/errors": int(failed.sum())})

    def take_metrics(self) -> dict[str, float]:
        """The ``agent/*`` metrics of the episodes since the last call."""
        stats, self.stats = self.stats, []
        return episode_metrics(stats)


def samples_of(ep: EpisodeResult, index: int, *, drop: bool) -> list[Sample]:
    """The samples of episode ``index`` of a group with its reward set (0 when its environment failed) and its
    counts in the metadata (the first sample's also carries the episode's ``agent`` record). ``drop``: an episode
    of the group failed under ``on_error: drop``."""
    st = ep.stats
    reward = 0.0 if st.error is not None else float(st.reward)
    for k, s in enumerate(ep.samples):
        s.reward = reward
        s.rewards = {"env": float(st.env_reward), "function": float(st.function_reward)}
        s.metadata = {"episode": index, "part": k, "env_error": st.error, "drop": drop, "tool_calls": st.tool_calls,
                      "truncated": st.truncated, **({"agent": stats_record(st)} if k == 0 else {})}
    return ep.samples
