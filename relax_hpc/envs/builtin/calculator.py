"""Arithmetic word problems with a tool (``recipes/data/arithmetic.jsonl``): the model may call ``calculate`` (an
arithmetic expression evaluator, no code execution) or, in :class:`PythonToolEnv`, ``python`` (code in the
sandbox), then answers; the reward is 1 when the last number of the answer equals the reference."""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

from relax_hpc.envs.api import Message, Task
from relax_hpc.envs.tool_env import ToolEnvironment

SYSTEM = ("Solve the problem. You may call a tool to compute; when you know the result, answer with the number "
          "alone on the last line.")

_OPS: dict[type, Callable[..., Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                                        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv,
                                        ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
                                        ast.UAdd: operator.pos}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"not an arithmetic expression: {ast.dump(node)[:60]}")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses) and return the result."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = _eval(ast.parse(expression, mode="eval"))
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


class CalculatorEnv(ToolEnvironment):
    """Word problem -> (tool calls) -> numeric answer; reward 1 if it matches ``task.answer``."""

    def __init__(self, system_prompt: str = SYSTEM):
        self.system_prompt = system_prompt

    def tools(self) -> Sequence[Callable[..., Any]]:
        return [calculate]

    def first_messages(self, task: Task) -> list[Message]:
        prompt = task.prompt if isinstance(task.prompt, str) else task.prompt[-1]["content"]
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": prompt}]

    def score(self, answer: str) -> float:
        got = last_number(answer)
        if got is None:
            return 0.0
        try:
            return float(abs(float(got) - float(str(self.task.answer))) < 1e-6)
        except ValueError:
            return 0.0


class PythonToolEnv(CalculatorEnv):
    """As :class:`CalculatorEnv`, with a ``python`` tool that runs code in the sandbox (``rollout.env.sandbox``)."""

    def tools(self) -> Sequence[Callable[..., Any]]:
        from relax_hpc.config.schema import SandboxConfig
        from relax_hpc.envs.sandbox import python_tool

        return [python_tool(getattr(self, "sandbox", None) or SandboxConfig())]
