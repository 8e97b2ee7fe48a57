"""An environment whose steps are tool calls: it runs the model's calls and answers with their results; a turn
without tool calls is the final answer, scored by :meth:`ToolEnvironment.score`. Subclasses list their tools and
score the answer."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from relax_hpc.envs.api import AssistantTurn, Environment, Message, Step, Task
from relax_hpc.envs.tools import ToolSet


class ToolEnvironment(Environment):
    """Tool loop: calls -> ``tool`` messages (errors included, counted); no call -> done, reward ``score``."""

    tool_timeout_s: float = 30.0

    def configure(self, cfg: Any) -> None:
        """Take the recipe's ``rollout.env`` settings (tool timeout, sandbox) before ``reset``."""
        self.tool_timeout_s = cfg.tool_timeout_s
        self.sandbox = cfg.sandbox

    @abstractmethod
    def tools(self) -> Sequence[Callable[..., Any]]: ...

    @abstractmethod
    def score(self, answer: str) -> float:
        """Reward of the final answer."""

    @abstractmethod
    def first_messages(self, task: Task) -> list[Message]: ...

    async def reset(self, task: Task, seed: int) -> list[Message]:
        self.task = task
        self.seed = seed
        self._toolset = ToolSet(list(self.tools()), timeout_s=self.tool_timeout_s)
        return self.first_messages(task)

    async def step(self, turn: AssistantTurn) -> Step:
        if not turn.tool_calls and not turn.parse_errors:
            return Step([], self.score(turn.content), True)
        results = [await self._toolset.call(c) for c in turn.tool_calls]
        messages: list[Message] = [{"role": "tool", "content": r.content} for r in results]
        messages += [{"role": "tool", "content": f"error: {e}"} for e in turn.parse_errors]
        errors = [r.error for r in results if r.error] + ["parse"] * len(turn.parse_errors)
        info = {"tool_calls": len(turn.tool_calls) + len(turn.parse_errors), "tool_errors": len(errors),
                "tool_latency_s": sum(r.latency_s for r in results), "tool_error_kinds": errors}
        return Step(messages, 0.0, False, info)
