"""tools/gpu/x2.sh and x8.sh (the multi-GPU runs of issues 17 and 18) in their dry-run mode: on this CPU machine,
tiny shapes, ``--device cpu`` (gloo where the GPU runs use NCCL), the same command lines, one JSON line of figures
per run. What this checks is that the commands parse and the figures come out, not any figure."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script(name: str, *args: str, out: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "SCRATCH": str(out.parent / "scratch"),
           "PYTHONPATH": str(REPO)}
    return subprocess.run(["bash", str(REPO / "tools" / "gpu" / name), *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def test_scripts_refuse_bad_arguments(tmp_path):
    r = _script("x2.sh", "p5", out=tmp_path / "a")
    assert r.returncode == 2 and "unknown part p5" in r.stderr
    r = _script("x8.sh", "x3", out=tmp_path / "b")
    assert r.returncode == 2 and "x8 or x4" in r.stderr
    r = _script("x8.sh", "x4", "3", out=tmp_path / "c")
    assert r.returncode == 2 and "give 1 or 2" in r.stderr
    r = subprocess.run(["python3", str(REPO / "tools" / "gpu" / "figures.py"), "gone", str(tmp_path / "none.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and json.loads(r.stdout)["run"] == "gone" and "error" in json.loads(r.stdout)


@pytest.mark.integration
@pytest.mark.slow
def test_x2_dry_run_prints_the_figures(tmp_path):
    out = tmp_path / "out"
    r = _script("x2.sh", "p06", out=out, timeout=600)
    assert r.returncode == 0, (out / "err.log").read_text()[-3000:] if (out / "err.log").exists() else r.stderr
    lines = [json.loads(x) for x in (out / "figures.jsonl").read_text().splitlines()]
    assert lines[0] == {"run": "x2-qwen3-0.6b", "rc": 0}
    fig = lines[1]
    assert fig["run"] == "x2-qwen3-0.6b" and fig["shape"] == "qwen3-tiny" and fig["gpus"] == 2
    assert fig["device"] == "cpu" and fig["timed_steps"] == 1
    assert "trainer.num_ranks=2" in fig["layout"]["colocate"] and "GPUs [1]" in fig["layout"]["fully_async"]
    for k in ("colocate_s_per_step", "fully_async_s_per_step", "speedup", "ideal_speedup", "efficiency_vs_ideal",
              "t_gen", "t_train"):
        assert isinstance(fig[k], float) and math.isfinite(fig[k]) and fig[k] > 0, k
    assert fig["speedup"] == pytest.approx(fig["colocate_s_per_step"] / fig["fully_async_s_per_step"])
    assert 1.0 <= fig["ideal_speedup"] <= 2.0
    # the fast path ran over gloo (the CPU's backend for auto), read from the run's rendezvous files
    assert fig["fast_path_backends"] == ["gloo"] and fig["fast_path_is_nccl"] is False
    assert fig["gpu_samples"] == 0 and fig["gpu_busy_fully_async"] is None  # no nvidia-smi here
    assert set(fig["train_tokens_per_s"]) == {"colocate", "fully_async"}
    assert all(v > 0 for v in fig["train_tokens_per_s"].values())
    raw = json.loads((out / "x2-qwen3-0.6b.json").read_text())
    assert "weights.fast_path=gloo" not in raw["overrides"]  # two GPUs: auto, which is NCCL there
    assert "files_run" in raw["handover"] and raw["params"] > 0


SLOW = [pytest.mark.integration, pytest.mark.slow]
MEGATRON_GPU_TESTS = {"meg6.sh": 5, "meg5.sh": 5, "meg8.sh": 6}
"""How many gpu tests each script names (test_megatron_gpu.py's four, the shared-GPU TP case; meg8 the GPU colocate
demo too)."""


@pytest.mark.parametrize("name", ["meg6.sh", pytest.param("meg5.sh", marks=SLOW), pytest.param("meg8.sh", marks=SLOW)])
def test_megatron_gpu_scripts_dry_run(tmp_path, name):
    """tools/gpu/meg5.sh / meg6.sh / meg8.sh (issue 16) with DRY_RUN=1: the gpu tests they name are collected (the
    node ids are not stale), and their bench trainer commands run at a tiny shape and give their JSON."""
    import re

    pytest.importorskip("megatron.core", reason="megatron-core is an optional extra")
    out = tmp_path / "out"
    r = _script(name, out=out, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    collected = (out / "gpu-tests.txt").read_text()
    count = re.search(r"(\d+) tests? collected", collected)
    assert count and int(count.group(1)) == MEGATRON_GPU_TESTS[name], collected
    assert "test_distributed_optimizer_in_bfloat16" in collected and "tied-cuda-shared" in collected, collected
    if name in ("meg5.sh", "meg8.sh"):
        for part in ("trainer06b", "trainer4b"):
            fig = json.loads((out / f"{part}.json").read_text())
            assert fig, part
