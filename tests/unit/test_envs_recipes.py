"""The shipped agentic recipes validate; the tiny ones run episodes with the tiny model on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from relax_hpc.config.load import load_recipe
from relax_hpc.envs.api import Task
from relax_hpc.envs.metrics import METRIC_NAMES, episode_metrics, stats_of_samples
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
from tests.helpers.agentic_helpers import ModelEngine, env_driver, task_prompts

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.mark.parametrize(("name", "env", "mode"), [
    ("qwen3-1.7b-calculator-tool.yaml", "calculator", "colocate"),
    ("qwen3-4b-guess-number.yaml", "guess_number", "fully_async"),
    ("tiny-digit-lookup-tool.yaml", "digit_lookup", "colocate"),
    ("tiny-guess-number.yaml", "guess_number", "colocate"),
])
def test_agentic_recipes_validate(name: str, env: str, mode: str) -> None:
    cfg = load_recipe(RECIPES / name)
    assert cfg.rollout.env is not None and cfg.rollout.env.name == env and cfg.mode == mode


@pytest.mark.parametrize("name", ["tiny-digit-lookup-tool.yaml", "tiny-guess-number.yaml"])
def test_tiny_recipes_run_episodes_on_cpu(name: str) -> None:
    cfg = load_recipe(RECIPES / name)
    tok = build_digits_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(cfg.model.tiny, len(tok), pad_token_id=tok.pad_token_id)
    engine = ModelEngine(model, tok, chunk=cfg.rollout.sampling.max_new_tokens)
    driver = env_driver(cfg, tok, engine)
    res = driver.run_batch(task_prompts([Task(f"C{i:02d}", f"{i:02d}") for i in range(4)]))
    samples = [s for g in res.groups for s in g.samples]
    eps = stats_of_samples(s.metadata for s in samples)  # each episode's record rides on its first sample
    assert len(eps) == 4 * cfg.rollout.n_samples and len(res.groups) == 4
    for s in samples:
        assert len(s.prompt_ids) + len(s.response_ids) <= cfg.rollout.env.max_total_tokens
        assert s.loss_mask.sum() == sum(b - a for a, b in s.turns)
    assert [s.reward for s in samples if "agent" in s.metadata] == pytest.approx([e.reward for e in eps])
    m = {k: v for k, v in res.counts.items() if k.startswith("agent/")}
    assert m == episode_metrics(eps) and set(m) == set(METRIC_NAMES) and m["agent/turns_per_episode"] >= 1
    assert max(e.turns for e in eps) > 1  # some episodes went on after the environment answered
    assert np.isfinite(m["agent/episode_reward"])


def test_episode_groups_round_trip_through_the_store(tmp_path: Path) -> None:
    """Episodes -> store group -> real HDF5 shard -> consumer: tokens, mask, per-token staleness, turns and the
    episode's reward and its parts kept."""
    from relax_hpc.rundir import RunDir
    from relax_hpc.store.consumer import ConsumerGroup
    from relax_hpc.store.writer import ShardWriter

    cfg = load_recipe(RECIPES / "tiny-digit-lookup-tool.yaml")
    tok = build_digits_tokenizer()
    torch.manual_seed(1)
    model = build_tiny_model(cfg.model.tiny, len(tok), pad_token_id=tok.pad_token_id)
    engine = ModelEngine(model, tok, chunk=2)
    engine.version = 3
    rd = RunDir.create(tmp_path / "run")
    driver = env_driver(cfg, tok, engine, n=4, writer=ShardWriter(rd, "rollout-0.a"), writer_id="rollout-0.a")
    res = driver.run_batch(task_prompts([Task(f"{i}") for i in range(3)]))
    c = ConsumerGroup(rd)
    got = c.read(c.plan(1, num_groups=3, timeout_s=5))
    want = [s for g in res.groups for s in g.samples]
    assert len(got) == len(want) == 12
    for s, w in zip(sorted(got, key=lambda s: (s.group_id, s.metadata["episode"])), want):
        assert np.array_equal(s.response_ids, w.response_ids) and np.array_equal(s.loss_mask, w.loss_mask)
        assert s.version == w.version_range(-1)[0] == 3 and s.turns.dtype == w.turns.dtype
        assert s.turns.tobytes() == w.turns.tobytes() and "turns" not in s.metadata  # the store's column
        assert s.reward == w.reward and s.rewards == w.rewards and set(s.rewards) == {"env", "function"}


FLAKY_ENV = '''
from relax_hpc.envs.api import Environment, Step

class Flaky(Environment):
    """Raises in step() for the task "bad", in close() for the task "late" (its samples are complete)."""
    async def reset(self, task, seed):
        self.task = task
        return [{"role": "user", "content": "1"}]
    async def step(self, turn):
        if self.task.prompt == "bad":
            raise RuntimeError("flaky")
        return Step([], 0.5, True)
    async def close(self):
        if self.task.prompt == "late":
            raise RuntimeError("flaky close")
'''


@pytest.mark.parametrize("on_error", ["drop", "zero"])
def test_env_errors_drop_or_zero_the_group(tmp_path: Path, on_error: str) -> None:
    from relax_hpc.config.load import validate_dict
    from tests.helpers.agentic_helpers import ScriptedEngine

    (tmp_path / "flaky.py").write_text(FLAKY_ENV)
    cfg = validate_dict({"data": {"task": {"name": "copy_digits"}}, "rollout": {"env": {
        "name": f"{tmp_path / 'flaky.py'}:Flaky", "tool_parser": "none", "on_error": on_error}}})
    tok = build_digits_tokenizer()
    driver = env_driver(cfg, tok, ScriptedEngine(tok, ["1"] * 12), n=4)
    res = driver.run_batch(task_prompts([Task("bad"), Task("late"), Task("good")]))
    bad, late, good = res.generated
    assert bad == []  # failed before any sample was complete: an empty group, never written
    assert all(s.metadata["drop"] == (on_error == "drop") for s in late) and not any(s.metadata["drop"] for s in good)
    assert [g.group_id for g in res.groups] == (["rollout-0.t:2"] if on_error == "drop" else
                                               ["rollout-0.t:1", "rollout-0.t:2"])
    assert res.counts["rollout/groups_dropped_reward_error"] == (on_error == "drop")
    assert res.counts["rollout/groups_empty"] == 1 and res.reward_errors == 4
    assert all("flaky close" in s.metadata["env_error"] for s in late)
    assert all(s.reward == 0.0 for s in late) and all(s.reward == 0.5 for s in good)
    assert res.counts["agent/env_errors"] == 8


def test_reward_from_env_function_or_both() -> None:
    from relax_hpc.config.load import validate_dict
    from tests.helpers.agentic_helpers import ScriptedEngine, qwen_style_tokenizer

    tok = qwen_style_tokenizer()
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "4*21"}}</tool_call>'
    got = {}
    for mode in ("env", "function", "both"):
        cfg = validate_dict({"data": {"task": {"name": "copy_digits"}}, "reward": {"name": "exact_match"},
                             "rollout": {"env": {"name": "calculator", "reward": mode, "env_reward_weight": 0.5,
                                                 "function_reward_weight": 2.0}}})
        driver = env_driver(cfg, tok, ScriptedEngine(tok, [call, "84"]), n=1)
        (s,) = driver.run_batch(task_prompts([Task("4 x 21?", "84")])).groups[0].samples
        got[mode] = s.reward
        assert s.rewards == {"env": 1.0, "function": 0.0 if mode == "env" else 1.0}  # the parts computed
    assert got == {"env": 1.0, "function": 1.0, "both": 2.5}


def test_data_prompts_become_tasks() -> None:
    from relax_hpc.data.dataset import PromptDataset
    from relax_hpc.envs.api import task_of

    cfg = load_recipe(RECIPES / "qwen3-1.7b-calculator-tool.yaml", ["model.path=tiny"])
    ds = PromptDataset(cfg.data, build_digits_tokenizer(), 0)
    task = task_of(ds[0])
    assert isinstance(task.prompt, str) and "How many" in task.prompt and task.answer == ds[0].answer
