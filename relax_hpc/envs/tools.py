"""Tools: typed Python callables offered to the model, their JSON schemas, and calls that never crash an episode.

A tool is a plain function (sync or ``async def``) with type-annotated parameters and a docstring; its JSON schema
(the OpenAI/HF "function" format that chat templates render into their tool section) comes from the signature
through pydantic, which also validates the model's arguments before the call. A parameter without an annotation or
with a type that has no JSON schema is refused when the recipe is validated (:func:`check_tool`).

A bad call - an unknown tool, arguments that do not validate, a tool that raises or runs past its timeout - comes
back as an error result (a message the model reads on its next turn) and is counted; it is never an exception.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relax_hpc.envs.api import ToolCall

ErrorKind = str
"""``unknown_tool``, ``bad_arguments``, ``tool_raised``, ``timeout``, ``sandbox`` (killed or refused)."""


@dataclass(frozen=True)
class ToolResult:
    """What one call returned."""

    name: str
    content: str
    """The text the model reads (the error message when ``error`` is set)."""
    error: ErrorKind | None = None
    latency_s: float = 0.0


@dataclass(frozen=True)
class Tool:
    """A callable with its schema."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    validator: Any
    """pydantic model of the arguments."""

    @classmethod
    def from_callable(cls, fn: Callable[..., Any], name: str | None = None) -> Tool:
        """Build the tool; ``ValueError`` (one line) if the signature has no JSON schema."""
        from pydantic import ConfigDict, create_model

        tool_name = name or getattr(fn, "__name__", None) or type(fn).__name__
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"tool {tool_name!r}: no inspectable signature ({exc})") from None
        fields: dict[str, Any] = {}
        for p in sig.parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ValueError(f"tool {tool_name!r}: *args/**kwargs parameters have no JSON schema")
            if p.annotation is inspect.Parameter.empty:
                raise ValueError(f"tool {tool_name!r}: parameter {p.name!r} has no type annotation")
            fields[p.name] = (p.annotation, ... if p.default is inspect.Parameter.empty else p.default)
        try:
            model = create_model(f"{tool_name}_args", __config__=ConfigDict(extra="forbid"), **fields)
            params = model.model_json_schema()
        except Exception as exc:
            raise ValueError(f"tool {tool_name!r}: its signature has no JSON schema "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
        params.pop("title", None)
        for prop in params.get("properties", {}).values():
            prop.pop("title", None)
        doc = inspect.getdoc(fn) or ""
        schema = {"type": "function",
                  "function": {"name": tool_name, "description": doc.split("\n\n")[0].strip(), "parameters": params}}
        return cls(name=tool_name, fn=fn, schema=schema, validator=model)


def check_tool(fn: Callable[..., Any]) -> None:
    """Raise ``ValueError`` (one line) if ``fn`` cannot be a tool."""
    Tool.from_callable(fn)


class ToolSet:
    """The tools of one environment, called by name."""

    def __init__(self, fns: Sequence[Callable[..., Any] | Tool], *, timeout_s: float = 30.0):
        tools = [f if isinstance(f, Tool) else Tool.from_callable(f) for f in fns]
        self.tools = {t.name: t for t in tools}
        if len(self.tools) != len(tools):
            raise ValueError(f"tool names repeat: {[t.name for t in tools]}")
        self.timeout_s = timeout_s

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call; every failure becomes an error result."""
        t0 = time.perf_counter()
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call.name, f"error: unknown tool {call.name!r}; available: {sorted(self.tools)}",
                              "unknown_tool", time.perf_counter() - t0)
        try:
            args = dict(tool.validator.model_validate(call.arguments))
        except Exception as exc:
            first = str(exc).splitlines()
            return ToolResult(call.name, f"error: bad arguments for {call.name}: {'; '.join(first[:3])}",
                              "bad_arguments", time.perf_counter() - t0)
        try:
            if inspect.iscoroutinefunction(tool.fn):
                out = await asyncio.wait_for(tool.fn(**args), self.timeout_s)
            else:
                out = await asyncio.wait_for(asyncio.to_thread(tool.fn, **args), self.timeout_s)
        except asyncio.TimeoutError:
            return ToolResult(call.name, f"error: {call.name} timed out after {self.timeout_s:g}s", "timeout",
                              time.perf_counter() - t0)
        except Exception as exc:
            return ToolResult(call.name, f"error: {call.name} raised {type(exc).__name__}: {exc}", "tool_raised",
                              time.perf_counter() - t0)
        if isinstance(out, ToolResult):
            return ToolResult(call.name, out.content, out.error, time.perf_counter() - t0)
        return ToolResult(call.name, out if isinstance(out, str) else _to_text(out), None, time.perf_counter() - t0)


def _to_text(value: Any) -> str:
    import json

    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
