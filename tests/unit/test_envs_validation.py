"""Environments, tools and parsers named in a recipe are checked when it is validated (the schema, then
relax_hpc.launch.checks, as ``validate`` and ``submit`` do): one clear error line."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest

from relax_hpc.config.load import validate_dict
from relax_hpc.envs.api import ToolCall
from relax_hpc.envs.parsers import HermesParser
from relax_hpc.envs.tools import Tool, ToolSet
from relax_hpc.errors import ConfigError
from relax_hpc.launch.checks import check_plugins


def validated(data):
    return check_plugins(validate_dict(data))


def recipe(**env):
    return {"data": {"task": {"name": "copy_digits"}}, "rollout": {"env": env}}


USER_ENVS = '''
from relax_hpc.envs.api import Environment, Step

class Good(Environment):
    def __init__(self, level: int = 1):
        self.level = level
    async def reset(self, task, seed):
        return [{"role": "user", "content": "hi"}]
    async def step(self, turn):
        return Step([], 1.0, True)

class NoStep:
    async def reset(self, task, seed): ...
    async def close(self): ...

class SyncStep(Good):
    def step(self, turn):
        return None

class BadTool(Good):
    def tools(self):
        def f(x: object, sock) -> str:
            return ""
        return [f]

class OpaqueTool(Good):
    def tools(self):
        import threading
        def f(lock: threading.Lock) -> str:
            return ""
        return [f]
'''


@pytest.fixture()
def user_file(tmp_path: Path) -> str:
    p = tmp_path / "myenvs.py"
    p.write_text(textwrap.dedent(USER_ENVS))
    return str(p)


def one_line_error(data) -> str:
    with pytest.raises(ConfigError) as e:
        validated(data)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_good_env_and_builtins_validate(user_file: str) -> None:
    cfg = validated(recipe(name=f"{user_file}:Good", kwargs={"level": 3}))
    assert cfg.rollout.env is not None and cfg.rollout.env.kwargs == {"level": 3}
    for name in ("calculator", "python_tool", "guess_number", "digit_lookup"):
        validated(recipe(name=name))
    validated(recipe(name="digit_lookup", tool_parser="relax_hpc.envs.builtin.lookup:DigitCallParser"))


@pytest.mark.parametrize(("env", "words"), [
    ({"name": "no_such_env"}, "neither built-in"),
    ({"name": "relax_hpc.envs.builtin.calculator:Missing"}, "has no attribute 'Missing'"),
    ({"name": "no_such_module_xyz:Env"}, "cannot import environment"),
    ({"name": "calculator", "max_turns": 0}, "max_turns"),
    ({"name": "calculator", "kwargs": {"nope": 1}}, "cannot be built with rollout.env.kwargs"),
    ({"name": "calculator", "tool_parser": "xml"}, "tool parser 'xml'"),
    ({"name": "guess_number", "kwargs": {"low": 5, "high": 1}}, "low=5 must be below high=1"),
])
def test_bad_env_is_one_clear_error(env, words: str) -> None:
    assert words in one_line_error(recipe(**env))


@pytest.mark.parametrize(("cls", "words"), [
    ("NoStep", "has no method step()"),
    ("SyncStep", "must be `async def`"),
    ("BadTool", "parameter 'sock' has no type annotation"),
    ("OpaqueTool", "signature has no JSON schema"),
])
def test_bad_user_env_is_one_clear_error(user_file: str, cls: str, words: str) -> None:
    assert words in one_line_error(recipe(name=f"{user_file}:{cls}"))


def test_tool_schema_comes_from_the_signature() -> None:
    def search(query: str, k: int = 3, exact: bool = False) -> str:
        """Search the notes.

        Longer text not shown."""
        return query

    s = Tool.from_callable(search).schema
    assert s["function"]["name"] == "search" and s["function"]["description"] == "Search the notes."
    p = s["function"]["parameters"]
    assert p["required"] == ["query"]
    assert p["properties"]["k"] == {"type": "integer", "default": 3}
    assert p["properties"]["query"] == {"type": "string"}


def test_bad_calls_are_error_results_never_raise() -> None:
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    def boom() -> str:
        """Fail."""
        raise RuntimeError("kaput")

    ts = ToolSet([add, boom], timeout_s=5)

    def call(name, args):
        return asyncio.run(ts.call(ToolCall(name, args)))

    assert call("add", {"a": 2, "b": 3}).content == "5"
    unknown = call("mul", {})
    assert unknown.error == "unknown_tool" and "available: ['add', 'boom']" in unknown.content
    bad = call("add", {"a": "two", "b": 3})
    assert bad.error == "bad_arguments"
    extra = call("add", {"a": 1, "b": 2, "c": 3})
    assert extra.error == "bad_arguments"
    raised = call("boom", {})
    assert raised.error == "tool_raised" and "kaput" in raised.content


def test_hermes_parser() -> None:
    p = HermesParser()
    r = p.parse('Let me compute.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "4*21"}}\n'
                '</tool_call>\n<tool_call>{"name": "x", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert [c.name for c in r.calls] == ["calculate", "x"] and r.calls[1].arguments == {"a": 1}
    assert r.content == "Let me compute." and not r.errors
    r = p.parse('<tool_call>{"name": "calculate", "arguments": {"expression": </tool_call>')
    assert not r.calls and "malformed JSON" in r.errors[0]
    r = p.parse('<tool_call>["calculate"]</tool_call> and <tool_call>{"name": "f"')
    assert not r.calls and len(r.errors) == 2 and "without its </tool_call>" in r.errors[1]
    assert p.parse("84").content == "84"


@pytest.mark.parametrize(("env", "words"), [
    ("{name: no_such_env}", "environment 'no_such_env' is neither built-in"),
    ("{name: calculator, max_turns: 0}", "max_turns"),
    ("{name: 'relax_hpc.envs.api:Environment'}", "is abstract"),
])
def test_cli_validate_bad_env_exit_2_one_line(tmp_path: Path, env: str, words: str) -> None:
    from tests.helpers.runutil import cli

    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(f"data: {{task: {{name: copy_digits}}}}\nrollout:\n  env: {env}\n")
    r = cli("validate", str(recipe_file), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0]


def test_env_warmup_needs_an_env_with_the_hook() -> None:
    warm = {"steps": 5, "source": "env"}
    assert "needs rollout.env" in one_line_error({"data": {"task": {"name": "copy_digits"}}, "warmup": warm})
    assert "has no method warmup_examples" in one_line_error({**recipe(name="calculator"), "warmup": warm})
    cfg = validated({**recipe(name="digit_lookup"), "warmup": warm})
    assert cfg.warmup.source == "env"


def test_digit_lookup_warmup_examples_render_like_an_episode() -> None:
    """The tiny tool recipe's warm-up: per prompt one reading example (the tool's answer copied after a call turn)
    and the eleven first turns at weight 1/11, in the tokens an episode's context has."""
    from relax_hpc.config.load import load_recipe
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.modes.trainer_role import warmup_stream

    cfg = load_recipe(Path(__file__).parents[2] / "recipes" / "tiny-digit-lookup-tool.yaml", [])
    tok = build_digits_tokenizer()
    pairs = warmup_stream(cfg, tok).next_batch(3)
    assert len(pairs) == 3 * 12
    for k in range(3):
        read, *firsts = pairs[12 * k:12 * (k + 1)]
        text = tok.decode(read.prompt_ids, skip_special_tokens=False)
        assert read.weight == 1.0 and text.startswith("<bos>") and "=C" in text and text.endswith("=")
        answer = tok.decode(read.answer_ids[:-1])
        assert read.answer_ids[-1] == tok.eos_token_id and text.endswith(f"<eos>{answer}=")  # copies the tool
        assert {tok.decode(p.answer_ids[:1]) for p in firsts} == set("0123456789C")
        assert all(p.prompt_ids == firsts[0].prompt_ids and abs(p.weight - 1 / 11) < 1e-12 for p in firsts)
        assert read.prompt_ids[:len(firsts[0].prompt_ids)] == firsts[0].prompt_ids  # same prompt, then the call
