"""The Qwen3-4B fully_async recipes with server engines (sglang, vllm): validated and rendered (16 GPUs, trainer 8
and 8 rollout tasks with one server each, one heterogeneous job), the rendered text checked against golden sbatch
files (refresh after an intended change with ``RELAX_UPDATE_GOLDEN=1 pytest tests/unit/test_server_recipes.py``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from relax_hpc.config.load import load_recipe
from relax_hpc.launch.sbatch import render_run

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize(("name", "engine"), [("qwen3-4b-math-fully-async.yaml", "sglang"),
                                              ("qwen3-4b-math-fully-async-vllm.yaml", "vllm")])
def test_server_recipe_validates_and_renders(name, engine, tmp_path):
    cfg = load_recipe(RECIPES / name)
    assert cfg.rollout.engine == engine and cfg.mode == "fully_async" and cfg.launch.placement == "hetjob"
    lt, lr = cfg.launch.trainer, cfg.launch.rollout
    assert lt.nodes * lt.gpus_per_node == 8 and lr.nodes * lr.gpus_per_node == 8 and cfg.trainer.num_ranks == 8
    s = cfg.rollout.server
    # one server per rollout task, one task per GPU
    assert cfg.rollout.num_workers == lr.nodes * lr.tasks_per_node == 8 // (s.gpus_per_server or s.tp_size)
    assert s.partial_rollout and s.startup_timeout_s >= 600
    scripts = render_run(tmp_path / "run", cfg)
    assert len(scripts) == 1
    text = scripts[0].text
    assert "#SBATCH --gpus-per-node=8" in text and text.count("#SBATCH --ntasks-per-node=8") == 2
    assert "role rollout" in text and "role trainer" in text and "--het-group=1" in text
    res = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True, timeout=30)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize(("name", "golden"), [("qwen3-4b-math-fully-async.yaml", "qwen3-4b-fully-async-sglang.sbatch"),
                                              ("qwen3-4b-math-fully-async-vllm.yaml",
                                               "qwen3-4b-fully-async-vllm.sbatch")])
def test_server_recipe_golden_sbatch(name, golden):
    cfg = load_recipe(RECIPES / name)
    (script,) = render_run("/shared/runs/qwen3-4b-1", cfg, python="/opt/venv/bin/python", pythonpath=None)
    path = GOLDEN / golden
    if os.environ.get("RELAX_UPDATE_GOLDEN") == "1":
        path.write_text(script.text)
    assert path.is_file(), f"missing golden {path}; create it with RELAX_UPDATE_GOLDEN=1 pytest {__file__}"
    assert script.text == path.read_text(), (f"rendered sbatch differs from {path}; if intended, refresh with "
                                             "RELAX_UPDATE_GOLDEN=1 pytest tests/unit/test_server_recipes.py")
    assert script.kind == "hetjob" and script.ranks == tuple(range(8))
