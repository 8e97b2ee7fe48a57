"""The shipped real-model recipes validate without their data, and the shipped arithmetic data is what its script
makes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from relax_hpc.config.load import load_recipe
from relax_hpc.rewards.builtin import math_answer

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.mark.parametrize(("name", "mode", "data"), [
    ("qwen3-4b-math-fully-async.yaml", "fully_async", "data/math/train.jsonl"),
    ("qwen3-1.7b-gsm8k-colocate.yaml", "colocate", "data/gsm8k/train.jsonl"),
    ("qwen2.5-vl-3b-geo3k.yaml", "colocate", "data/geo3k/train.parquet"),
    ("qwen3-0.6b-arithmetic-colocate.yaml", "colocate", "data/arithmetic.jsonl"),
])
def test_real_model_recipes_validate(name, mode, data):
    cfg = load_recipe(RECIPES / name)
    assert cfg.mode == mode and cfg.reward.name == "math"
    assert cfg.data.path == str((RECIPES / data).resolve())  # resolved against the recipe's folder


def test_fully_async_recipe_shape():
    cfg = load_recipe(RECIPES / "qwen3-4b-math-fully-async.yaml")
    assert cfg.rollout.engine == "sglang" and cfg.launch.placement == "hetjob"
    gpus = (cfg.launch.trainer.nodes * cfg.launch.trainer.gpus_per_node
            + cfg.launch.rollout.nodes * cfg.launch.rollout.gpus_per_node)
    assert gpus == 16 and cfg.trainer.num_ranks == 8


def test_shipped_arithmetic_data_is_reproducible_and_correct(tmp_path):
    shipped = RECIPES / "data" / "arithmetic.jsonl"
    out = tmp_path / "a.jsonl"
    subprocess.run([sys.executable, str(RECIPES / "data" / "make_arithmetic.py"), "--out", str(out)], check=True,
                   capture_output=True)
    assert out.read_text() == shipped.read_text()
    rows = [json.loads(line) for line in shipped.read_text().splitlines()]
    assert len(rows) == 200 and len({r["prompt"] for r in rows}) == 200
    assert {r["op"] for r in rows} == {"add", "sub", "mul", "div", "two_step"}
    assert all(int(r["answer"]) > 0 for r in rows)
    for r in rows[:10]:
        assert math_answer(f"so \\boxed{{{r['answer']}}}", r["answer"]) == 1.0
