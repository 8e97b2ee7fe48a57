"""Tool-call parsers: an assistant turn's text -> (content, tool calls, errors). A parser is a small object with a
``parse(text)`` method, named in the recipe (``rollout.env.tool_parser``): a built-in name or ``module:Class``.

Built in: ``hermes`` - the Qwen/Hermes format, one JSON object per call between ``<tool_call>`` and
``</tool_call>``: ``{"name": ..., "arguments": {...}}``; ``none`` - no tool calls. A malformed call (bad JSON, no
``name``, arguments that are not an object, an unclosed tag) becomes a parse error the model is told about.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol

from relax_hpc.envs.api import ToolCall


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: list[ToolCall]
    errors: list[str]


class ToolCallParser(Protocol):
    def parse(self, text: str) -> Parsed: ...


class NoToolsParser:
    """Every turn is plain content."""

    def parse(self, text: str) -> Parsed:
        return Parsed(text, [], [])


class HermesParser:
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` (Qwen2.5/Qwen3, Hermes)."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self) -> None:
        self._block = re.compile(re.escape(self.open_tag) + r"(.*?)" + re.escape(self.close_tag), re.DOTALL)

    def parse(self, text: str) -> Parsed:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for k, m in enumerate(self._block.finditer(text)):
            call, err = self._one(m.group(1).strip(), k)
            if call is not None:
                calls.append(call)
            else:
                errors.append(err)
        rest = self._block.sub("", text)
        if self.open_tag in rest:
            errors.append(f"a {self.open_tag} without its {self.close_tag}")
            rest = rest.split(self.open_tag)[0]
        return Parsed(rest.strip(), calls, errors)

    def _one(self, body: str, k: int) -> tuple[ToolCall | None, str]:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            return None, f"tool call {k}: malformed JSON ({exc.msg} at char {exc.pos})"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, f"tool call {k}: expected an object with a string \"name\""
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None, f"tool call {k}: \"arguments\" is a string that is not JSON"
        if not isinstance(args, dict):
            return None, f"tool call {k}: \"arguments\" must be an object"
        return ToolCall(obj["name"], args, f"call_{k}"), ""


PARSERS: dict[str, type] = {"hermes": HermesParser, "none": NoToolsParser}


def resolve_parser(name: str) -> ToolCallParser:
    """An instance of the parser ``name`` (built-in or ``module:Class``); ValueError (one line) otherwise."""
    cls = PARSERS.get(name)
    if cls is None:
        from relax_hpc.plugins import load_object

        if ":" not in name:
            raise ValueError(f"tool parser {name!r} is neither built-in ({', '.join(sorted(PARSERS))}) "
                             "nor module:Class")
        cls = load_object(name, "tool parser")
    parser = cls() if isinstance(cls, type) else cls
    if not callable(getattr(parser, "parse", None)):
        raise ValueError(f"tool parser {name!r} has no parse(text) method")
    return parser
