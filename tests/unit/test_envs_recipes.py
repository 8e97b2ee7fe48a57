"""The shipped agentic recipes validate; the tiny ones run episodes with the tiny model on the CPU."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from relax_hpc.config.load import load_recipe
from relax_hpc.envs.api import Task
from relax_hpc.envs.metrics import METRIC_NAMES, episode_metrics
from relax_hpc.envs.rollout import EpisodeRunner
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
from tests.helpers.agentic_helpers import ModelEngine

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
    runner = EpisodeRunner(cfg, tok)

    async def main():
        return await asyncio.gather(*(runner.run_group(engine, Task(f"C{i:02d}", f"{i:02d}"), n=cfg.rollout.n_samples,
                                                       seed=i, group_id=f"g{i}") for i in range(4)))

    groups = asyncio.run(main())
    eps = [e for g in groups for e in g.episodes]
    assert len(eps) == 4 * cfg.rollout.n_samples and not any(g.dropped for g in groups)
    for e in eps:
        for s in e.samples:
            assert len(s.prompt_ids) + len(s.response_ids) <= cfg.rollout.env.max_total_tokens
            assert s.loss_mask.sum() == sum(b - a for a, b in s.turns)
    m = episode_metrics([e.stats for e in eps])
    assert set(m) == set(METRIC_NAMES) and m["agent/turns_per_episode"] >= 1
    assert max(e.stats.turns for e in eps) > 1  # some episodes went on after the environment answered
    assert np.isfinite(m["agent/episode_reward"])


def test_episode_groups_round_trip_through_the_store(tmp_path: Path) -> None:
    """Episodes -> store group -> real HDF5 shard -> consumer: tokens, mask, per-token staleness and turns kept."""
    from relax_hpc.envs.rollout import store_group
    from relax_hpc.rundir import RunDir
    from relax_hpc.store.consumer import ConsumerGroup
    from relax_hpc.store.writer import ShardWriter

    cfg = load_recipe(RECIPES / "tiny-digit-lookup-tool.yaml")
    tok = build_digits_tokenizer()
    torch.manual_seed(1)
    model = build_tiny_model(cfg.model.tiny, len(tok), pad_token_id=tok.pad_token_id)
    engine = ModelEngine(model, tok, chunk=2)
    engine.version = 3
    runner = EpisodeRunner(cfg, tok)

    async def main():
        return await asyncio.gather(*(runner.run_group(engine, Task(f"{i}"), n=4, seed=i, group_id=f"g{i}")
                                      for i in range(3)))

    groups = asyncio.run(main())
    rd = RunDir.create(tmp_path / "run")
    ShardWriter(rd, "rollout-0.a").write([store_group(g, f"rollout-0:{i}") for i, g in enumerate(groups)])
    c = ConsumerGroup(rd)
    got = c.read(c.plan(1, num_groups=3, timeout_s=5))
    want = [s for g in groups for e in g.episodes for s in e.samples]
    assert len(got) == len(want) == 12
    for s, w in zip(sorted(got, key=lambda s: (s.group_id, s.metadata["episode"])), want):
        assert np.array_equal(s.response_ids, w.response_ids) and np.array_equal(s.loss_mask, w.loss_mask)
        assert s.version == w.min_version == 3 and s.turns.dtype == w.turns.dtype
        assert s.turns.tobytes() == w.turns.tobytes() and "turns" not in s.metadata  # the store's column


FLAKY_ENV = '''
from relax_hpc.envs.api import Environment, Step

class Flaky(Environment):
    """Raises in step() for the task "bad"."""
    async def reset(self, task, seed):
        self.task = task
        return [{"role": "user", "content": "1"}]
    async def step(self, turn):
        if self.task.prompt == "bad":
            raise RuntimeError("flaky")
        return Step([], 0.5, True)
'''


@pytest.mark.parametrize("on_error", ["drop", "zero"])
def test_env_errors_drop_or_zero_the_group(tmp_path: Path, on_error: str) -> None:
    from relax_hpc.config.load import validate_dict
    from tests.helpers.agentic_helpers import ScriptedEngine

    (tmp_path / "flaky.py").write_text(FLAKY_ENV)
    cfg = validate_dict({"data": {"task": {"name": "copy_digits"}}, "rollout": {"env": {
        "name": f"{tmp_path / 'flaky.py'}:Flaky", "tool_parser": "none", "on_error": on_error}}})
    tok = build_digits_tokenizer()
    runner = EpisodeRunner(cfg, tok)
    engine = ScriptedEngine(tok, ["1"] * 8)

    async def main():
        return await asyncio.gather(runner.run_group(engine, Task("bad"), n=4, seed=0, group_id="b"),
                                    runner.run_group(engine, Task("good"), n=4, seed=1, group_id="g"))

    bad, good = asyncio.run(main())
    assert bad.dropped == (on_error == "drop") and not good.dropped
    assert all(e.stats.error and "flaky" in e.stats.error for e in bad.episodes)
    assert all(e.stats.reward == 0.0 for e in bad.episodes) and all(e.stats.reward == 0.5 for e in good.episodes)
    assert episode_metrics([e.stats for e in bad.episodes + good.episodes])["agent/env_errors"] == 4


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
        runner = EpisodeRunner(cfg, tok)
        g = asyncio.run(runner.run_group(ScriptedEngine(tok, [call, "84"]), Task("4 x 21?", "84"), n=1, seed=0,
                                         group_id=mode))
        got[mode] = g.episodes[0].stats.reward
    assert got == {"env": 1.0, "function": 1.0, "both": 2.5}


def test_data_prompts_become_tasks() -> None:
    from relax_hpc.data.dataset import PromptDataset
    from relax_hpc.envs.rollout import task_of

    cfg = load_recipe(RECIPES / "qwen3-1.7b-calculator-tool.yaml", ["model.path=tiny"])
    ds = PromptDataset(cfg.data, build_digits_tokenizer(), 0)
    task = task_of(ds[0])
    assert isinstance(task.prompt, str) and "How many" in task.prompt and task.answer == ds[0].answer
