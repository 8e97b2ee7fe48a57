"""The environment protocol of multi-turn (agentic) episodes: a few async methods, messages in, messages out.

An episode is: ``reset(task, seed)`` gives the first messages (the prompt, as chat messages); then, turn by turn,
the model writes an assistant turn and ``step(turn)`` answers with the environment's new messages (tool results,
feedback), a reward and whether the episode is over; ``close()`` releases what the environment holds. Token
bookkeeping is not the environment's business: :mod:`relax_hpc.envs.tokens` turns the messages into tokens exactly
once, and :mod:`relax_hpc.envs.episode` enforces the recipe's limits (turns, tokens, step timeout).

An environment that offers tools lists them in :meth:`Environment.tools` (typed Python callables, see
:mod:`relax_hpc.envs.tools`); they are rendered into the chat template's tool section, and
:class:`relax_hpc.envs.tool_env.ToolEnvironment` runs the model's calls for it.

An environment may also offer the optional hook ``warmup_examples(task, rng) -> list[WarmupExample]``
(:class:`WarmsUp`): supervised examples for the recipe's warm-up (``warmup.source: env``), as messages, so that RL
starts from a policy that sometimes succeeds (e.g. one that can read a tool's answer but has not learnt to call it).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]
"""A chat message: ``{"role": "user" | "assistant" | "tool" | "system", "content": str, ...}``."""

REQUIRED_METHODS = ("reset", "step", "close")
WARMUP_METHOD = "warmup_examples"


@dataclass(frozen=True)
class Task:
    """One row of the data, as the environment sees it."""

    prompt: Any
    """The row's prompt field (a string or a list of chat messages)."""
    answer: Any = None
    """The reference answer, if the data has one."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The row's other fields."""


def task_of(prompt: Any) -> Task:
    """The environment's task for a data prompt (:class:`relax_hpc.data.dataset.Prompt`)."""
    return Task(prompt=prompt.raw, answer=prompt.answer, meta=dict(prompt.meta))


@dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from an assistant turn."""

    name: str
    arguments: dict[str, Any]
    call_id: str = ""


@dataclass(frozen=True)
class AssistantTurn:
    """What the model wrote in one turn."""

    text: str
    """The decoded turn (special tokens kept, the end-of-turn token removed)."""
    content: str
    """``text`` without the tool calls (what the parser left)."""
    tool_calls: list[ToolCall]
    """The well-formed tool calls, in order."""
    parse_errors: list[str]
    """One message per malformed tool call (malformed JSON, missing name ...)."""
    finish_reason: str
    """``stop`` (the model ended its turn) or ``length`` (cut at the turn's token budget)."""


@dataclass
class Step:
    """The environment's answer to one assistant turn."""

    messages: list[Message]
    """New messages appended to the conversation (tool results, feedback); may be empty when ``done``."""
    reward: float = 0.0
    """Reward of this step; an episode's environment reward is the sum over its steps."""
    done: bool = False
    """The episode is over."""
    info: dict[str, Any] = field(default_factory=dict)
    """Anything to record; numeric values of the keys ``tool_calls``, ``tool_errors``, ``tool_latency_s`` and
    ``truncated_outputs`` are counted in the episode's metrics."""


class Environment(ABC):
    """One episode at a time; a fresh instance per episode (``rollout.env.name`` names the class, ``kwargs`` are
    given to its constructor)."""

    def tools(self) -> Sequence[Callable[..., Any]]:
        """Typed callables offered to the model as tools (none by default)."""
        return ()

    @abstractmethod
    async def reset(self, task: Task, seed: int) -> list[Message]:
        """Start an episode on ``task``: the first messages (at least one)."""

    @abstractmethod
    async def step(self, turn: AssistantTurn) -> Step:
        """Answer the model's turn."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (subprocesses, files)."""


@dataclass(frozen=True)
class WarmupExample:
    """One supervised example of the warm-up: after ``messages`` (rendered with the chat template, tools and
    generation prompt, as an episode renders them) the model should write ``answer`` and end its turn."""

    messages: list[Message]
    """The conversation before the turn to learn (the first messages, earlier turns, tool results)."""
    answer: str
    """The assistant turn to learn (its tokens and the end-of-turn token carry the loss)."""
    weight: float = 1.0
    """Weight of the example's tokens in the loss: e.g. ``1/k`` on each of k alternative first turns, whose loss
    is then the cross-entropy to the uniform distribution over them."""


@runtime_checkable
class WarmsUp(Protocol):
    """An environment with the optional warm-up hook (``warmup.source: env``)."""

    def warmup_examples(self, task: Task, rng: random.Random) -> list[WarmupExample]:
        """Supervised examples for one data task; ``rng`` draws anything random (seeded by the run)."""
        ...
