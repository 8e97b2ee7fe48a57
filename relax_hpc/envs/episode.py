"""One episode: the model and an environment take turns until the environment is done or a limit is reached.

Per turn: generate through the rollout driver's :class:`~relax_hpc.rollout.driver.EpisodeContext` (an aborted
request - a weight update mid-turn - is resubmitted with its partial tokens as the prefix by the driver's one
abort-and-resubmit loop, so the turn continues with the new weights and each token keeps its version), parse tool
calls, let the
environment answer (under ``step_timeout_s``), cut long environment messages, and append only the new tokens
(:mod:`relax_hpc.envs.tokens`). The reward is the environment's (summed over steps), the reward function's on the
final assistant turn, or their weighted sum. An environment that raises or times out ends the episode with
``error`` set; the caller drops it or scores it 0 (``rollout.env.on_error``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from relax_hpc.config.schema import EnvConfig
from relax_hpc.data.dataset import Prompt
from relax_hpc.envs.api import AssistantTurn, Environment, Step, Task
from relax_hpc.envs.parsers import ToolCallParser
from relax_hpc.envs.tokens import Transcript, truncate_message
from relax_hpc.envs.tools import Tool
from relax_hpc.record import Sample
from relax_hpc.rollout.driver import EpisodeContext
from relax_hpc.rollout.engine import RolloutEngine, SamplingParams

log = logging.getLogger(__name__)

Scorer = Callable[[str, Task], Awaitable[float]]


@dataclass
class EpisodeStats:
    """Counts of one episode (summed into the ``agent/*`` metrics)."""

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_latency_s: float = 0.0
    truncated_outputs: int = 0
    """Environment messages cut at ``max_tool_output_tokens``."""
    truncated: str | None = None
    """Why the episode stopped before the environment was done: ``max_turns``, ``max_total_tokens``,
    ``max_samples``, ``aborts``."""
    aborted_turns: int = 0
    """Turns that a weight update interrupted (and that continued with the new weights)."""
    samples: int = 0
    env_reward: float = 0.0
    function_reward: float = 0.0
    reward: float = 0.0
    error: str | None = None
    """The environment raised or timed out."""
    seconds: float = 0.0


@dataclass
class EpisodeResult:
    samples: list[Sample]
    """The episode's samples (several when the chat template is not prefix-preserving), rewards not yet set."""
    stats: EpisodeStats
    final_answer: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)


async def run_episode(engine: RolloutEngine, env: Environment, task: Task, *, tokenizer: Any, cfg: EnvConfig,
                      sampling: SamplingParams, parser: ToolCallParser, seed: int, request_id: str,
                      scorer: Scorer | None = None, reward_mode: str | None = None) -> EpisodeResult:
    """One episode on its own (outside a rollout driver): :func:`play` with a context of its own."""
    return await play(EpisodeContext(engine, sampling, request_id), env, task, tokenizer=tokenizer, cfg=cfg,
                      parser=parser, seed=seed, scorer=scorer, reward_mode=reward_mode)


async def play(ctx: EpisodeContext, env: Environment, task: Task, *, tokenizer: Any, cfg: EnvConfig,
               parser: ToolCallParser, seed: int, scorer: Scorer | None = None, reward_mode: str | None = None,
               name: str = "e0") -> EpisodeResult:
    """Run one episode to the end with ``ctx``'s engine and sampling settings (one sample per turn request, the
    engine's own generator); never raises for the environment's or the model's faults. ``name``: the episode's
    within its group (its requests are ``<request_id>/<name>.t<turn>/<n>``)."""
    t0 = time.perf_counter()
    stats = EpisodeStats()
    result = EpisodeResult([], stats)
    try:
        await _episode(ctx, env, task, tokenizer, cfg, parser, seed, result, name)
        await _reward(result, task, cfg, scorer, reward_mode or cfg.reward)
    except _EnvFault as exc:
        stats.error = str(exc)
        log.warning("episode %s/%s: %s", ctx.request_id, name, exc)
    finally:
        try:
            await asyncio.wait_for(env.close(), cfg.step_timeout_s)
        except Exception as exc:
            stats.error = stats.error or f"close() raised {type(exc).__name__}: {exc}"
    stats.samples = len(result.samples)
    stats.seconds = time.perf_counter() - t0
    return result


class _EnvFault(Exception):
    pass


async def _env_call(what: str, coro: Awaitable[Any], timeout_s: float) -> Any:
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError:
        raise _EnvFault(f"environment {what} timed out after {timeout_s:g}s") from None
    except Exception as exc:
        raise _EnvFault(f"environment {what} raised {type(exc).__name__}: {exc}") from None


async def _episode(ctx: EpisodeContext, env: Environment, task: Task, tokenizer: Any, cfg: EnvConfig,
                   parser: ToolCallParser, seed: int, result: EpisodeResult, name: str) -> None:
    stats = result.stats
    sampling = dataclasses.replace(ctx.sampling, n=1, seed=None)
    if callable(getattr(env, "configure", None)):
        env.configure(cfg)  # type: ignore[attr-defined]
    messages = await _env_call("reset()", env.reset(task, seed), cfg.step_timeout_s)
    tools = [Tool.from_callable(f).schema for f in env.tools()] or None
    tr = Transcript(tokenizer, messages, tools, dict(cfg.chat_template_kwargs))
    turn_cap = cfg.max_turn_tokens or sampling.max_new_tokens
    for k in range(cfg.max_turns):
        budget = min(turn_cap, cfg.max_total_tokens - tr.total_tokens)
        if budget <= 0:
            stats.truncated = "max_total_tokens"
            break
        turn = await ctx.generate(Prompt(prompt_ids=tr.context_ids, answer=None),
                                  dataclasses.replace(sampling, max_new_tokens=budget), tag=f"{name}.t{k}")
        stats.aborted_turns += turn.engine_calls - 1
        text = tr.add_turn(turn.response_ids, turn.logprobs, turn.token_versions(), turn.finish_reason)
        stats.turns += 1
        if turn.finish_reason == "abort":
            stats.truncated = "aborts"
            break
        if turn.finish_reason == "length" and tr.total_tokens >= cfg.max_total_tokens:
            stats.truncated = "max_total_tokens"  # the environment still answers (and scores) the cut turn
        parsed = parser.parse(text)
        result.final_answer = parsed.content
        step: Step = await _env_call("step()", env.step(AssistantTurn(text, parsed.content, parsed.calls,
                                                                      parsed.errors, turn.finish_reason)),
                                     cfg.step_timeout_s)
        _count(stats, step)
        if step.done or stats.truncated:
            break
        if k == cfg.max_turns - 1:
            stats.truncated = "max_turns"
            break
        new = []
        for m in step.messages:
            m, cut = truncate_message(tokenizer, m, cfg.max_tool_output_tokens, cfg.truncation_marker)
            stats.truncated_outputs += int(cut)
            new.append(m)
        if not tr.add_env(new):  # the template is not prefix-preserving here: a new sample
            result.samples.append(tr.sample())
            if len(result.samples) >= cfg.max_samples_per_episode:
                stats.truncated = "max_samples"
                tr = None
                break
            tr = tr.restart(new)
    if tr is not None and tr.turns:
        result.samples.append(tr.sample())
    result.messages = tr.messages if tr is not None else []


def _count(stats: EpisodeStats, step: Step) -> None:
    stats.env_reward += float(step.reward)
    info = step.info or {}
    stats.tool_calls += int(info.get("tool_calls", 0))
    stats.tool_errors += int(info.get("tool_errors", 0))
    stats.tool_latency_s += float(info.get("tool_latency_s", 0.0))
    stats.truncated_outputs += int(info.get("truncated_outputs", 0))


async def _reward(result: EpisodeResult, task: Task, cfg: EnvConfig, scorer: Scorer | None, mode: str) -> None:
    s = result.stats
    if mode in ("function", "both"):
        if scorer is None:
            raise ValueError(f"rollout.env.reward={mode} needs a reward function")
        s.function_reward = float(await scorer(result.final_answer, task))
    if mode == "env":
        s.reward = s.env_reward
    elif mode == "function":
        s.reward = s.function_reward
    else:
        s.reward = cfg.env_reward_weight * s.env_reward + cfg.function_reward_weight * s.function_reward
