"""tools/gpu/suite.sh, the one entry point of the GPU runs, on this CPU machine: bad targets and arguments are refused
with one error line, its help and tools/gpu/README.md name the same targets, and its DRY_RUN=1 mode runs the same
command lines at tiny shapes with ``--device cpu`` (gloo where the GPU runs use NCCL). What the dry runs check is that
the commands parse, the tests they name exist and the figures come out, not any figure."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "tools" / "gpu" / "suite.sh"
TARGETS = ["env", "tests", "step-0.6b", "step-4b", "megatron", "multi-gpu", "pipeline", "generate",
           "decode-attention", "carry"]


def suite(*args: str, out: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "SCRATCH": str(out.parent / "scratch"),
           "PYTHONPATH": str(REPO)}
    return subprocess.run(["bash", str(SUITE), *args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def test_tools_gpu_holds_one_entry_point_and_no_numbered_scripts() -> None:
    names = sorted(p.name for p in (REPO / "tools" / "gpu").iterdir() if p.is_file())
    assert [n for n in names if n.endswith(".sh")] == ["suite.sh"]
    assert not [n for n in names if re.search(r"\d\.(sh|py)$", n)], names


def test_help_and_readme_name_every_target(tmp_path) -> None:
    r = suite("--help", out=tmp_path / "o")
    assert r.returncode == 0 and r.stderr == ""
    readme = (REPO / "tools" / "gpu" / "README.md").read_text()
    for t in TARGETS:
        assert re.search(rf"^\s+{re.escape(t)}\b", r.stdout, re.M), t
        assert f"`{t}" in readme, t
    r = suite(out=tmp_path / "o")  # no target: the usage on stderr, exit 2
    assert r.returncode == 2 and "TARGET" in r.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["bogus"], "unknown target 'bogus'"),
    (["step-0.6b", "eager", "fast"], "step-0.6b: unknown variant fast"),
    (["step-4b", "peers"], "step-4b: unknown variant peers"),
    (["megatron", "bench"], "megatron: unknown part bench"),
    (["multi-gpu"], "multi-gpu: give x2, x4 or x8"),
    (["multi-gpu", "x2", "p5"], "unknown part p5"),
    (["multi-gpu", "x3"], "not 'x3'"),
    (["multi-gpu", "x4", "3"], "give 1 or 2"),
    (["carry", "plan", "--out", "/nonexistent/carry"], "no manifest"),
    (["proof", "go"], "proof: give start or collect"),
    (["proof", "start", "0", "x"], "seed 'x' is not a number"),
    (["proof", "collect", "soon"], "WAIT_S 'soon' is not a number"),
    (["vllm", "serve"], "vllm: unknown part serve"),
])
def test_bad_targets_and_arguments_get_one_error_line(tmp_path, args, message) -> None:
    r = suite(*args, out=tmp_path / "o")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "o" / "err.log").exists()


def test_figures_of_a_missing_result_and_of_parity_ranks(tmp_path) -> None:
    fig = REPO / "tools" / "gpu" / "figures.py"
    r = subprocess.run(["python3", str(fig), "gone", str(tmp_path / "none.json")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and json.loads(r.stdout)["run"] == "gone" and "error" in json.loads(r.stdout)
    for rank, logits in enumerate((1e-6, 3e-6)):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"logits": logits, "grads": 2e-5, "tp_size": 2,
                                                               "dp_size": 1, "loss_megatron": 0.5,
                                                               "loss_torch": 0.5}))
    r = subprocess.run(["python3", str(fig), "--parity", "megatron-parity-tied", str(tmp_path), "0"],
                       capture_output=True, text=True, timeout=60)
    line = json.loads(r.stdout)
    assert r.returncode == 0 and line["ranks"] == 2 and line["max_logits"] == 3e-6 and line["max_entropy"] is None
    assert line["tp_size"] == 2 and line["rc"] == 0


@pytest.mark.slow
def test_tests_target_dry_run_collects_the_gpu_tests(tmp_path) -> None:
    out = tmp_path / "out"
    r = suite("tests", out=out, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (out / "gpu-tests.txt").read_text()
    count = re.search(r"(\d+)/\d+ tests collected", text)
    assert count and int(count.group(1)) >= 20 and "error" not in text.lower(), text[-2000:]
    assert "test_graph_decode.py" in text and "megatron" not in text


@pytest.mark.integration
@pytest.mark.slow
def test_megatron_dry_run_collects_its_gpu_tests_and_runs_bench_trainer(tmp_path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is an optional extra")
    out = tmp_path / "out"
    r = suite("megatron", "tests", "trainer", out=out, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (out / "megatron-gpu-tests.txt").read_text()
    count = re.search(r"(\d+)/\d+ tests collected", text)
    assert count and int(count.group(1)) >= 5, text[-2000:]
    assert "test_distributed_optimizer_in_bfloat16" in text and "tied-cuda-shared" in text
    for part in ("trainer-megatron-qwen3-0.6b", "trainer-megatron-qwen3-4b"):
        fig = json.loads((out / f"{part}.json").read_text())
        assert fig["device"] == "cpu" and fig["tokens_per_s"] > 0, part


@pytest.mark.integration
@pytest.mark.slow
def test_multi_gpu_x2_dry_run_prints_the_figures(tmp_path) -> None:
    out = tmp_path / "out"
    r = suite("multi-gpu", "x2", "p06", out=out, timeout=600)
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
