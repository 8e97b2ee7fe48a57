"""``relax-hpc bench step`` end to end on the CPU (the tiny shape with the real Qwen vocabulary, one timed step,
transformers.generate as the peer, then the same loop with a LoRA adapter): exit 0 and every figure present and
sane; bad input gets one error line."""

from __future__ import annotations

import json

import pytest

from tests.helpers.runutil import cli


@pytest.mark.slow
def test_bench_step_cpu_json(tmp_path) -> None:
    r = cli("bench", "step", "--device", "cpu", "--shape", "qwen3-tiny", "--steps", "1", "--warmup-steps", "1",
            "--prompts", "2", "--samples", "2", "--new-tokens", "4", "--micro-batch-tokens", "512",
            "--peers", "generate", "--cache", str(tmp_path / "cache"), "--profile", str(tmp_path / "prof"), "--json",
            "--lora", "8", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["steps"] == 2 and len(res["per_step"]) == 2
    for k in ("step_s", "step_s_steady", "generate_s", "train_s", "hand_over_s", "generation_tokens_per_s",
              "train_tokens_per_s", "train_mfu", "generation_hbm_bound_s", "generation_vs_hbm_bound",
              "generate_static_tokens_per_s"):
        assert isinstance(res[k], float) and res[k] > 0, k
    assert res["response_tokens_mean"] <= 4 and res["prompt_tokens_mean"] > 10  # chat template + system prompt
    # uniform lengths: every row of a step's batch runs to the same end
    assert res["lengths"] == "uniform (4)" and res["critical_path_tokens"] == 4
    assert res["decode_occupancy"] == 1.0 and res["decode_low_occupancy_s"] == 0
    assert 0 < res["hand_over_share_of_step"] < 1
    assert (tmp_path / "cache" / "qwen-vocab" / "tokenizer.json").is_file()
    prof = res["profile"]  # --profile: one generation call and one training step under torch.profiler
    assert prof["decode_ms_per_step"] > 0 and prof["profiled_train_step_s"] > 0
    for table in ("decode_profile.txt", "train_profile.txt"):
        assert "Self CPU" in (tmp_path / "prof" / table).read_text()
    # --lora 8: the same loop with a rank-8 adapter (alpha 16) on the default targets of the 2-layer shape: per layer
    # r x (in + out) of q (64, 64), k and v (64, 32), o (64, 64), gate and up (64, 128), down (128, 64)
    assert res["lora_rank"] == 8 and res["lora_alpha"] == 16.0
    assert res["lora_trainable_params"] == 2 * 8 * (128 + 96 + 96 + 128 + 192 + 192 + 192)
    assert len(res["lora_per_step"]) == 2
    for k in ("lora_step_s_steady", "lora_train_s", "lora_hand_over_s", "lora_step_vs_full", "lora_train_vs_full"):
        assert isinstance(res[k], float) and res[k] > 0, k
    assert res["lora_peak_gpu_memory_gb"] is None  # no GPU: no memory figure (NaN in Python, null in JSON)


def test_bench_step_cuda_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = cli("bench", "step", "--device", "cuda", "--peers", "none", timeout=120)
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, words", [(["--lora", "0"], "--lora: a rank >= 1"),
                                         (["--lora", "8", "--backend", "megatron"], "does not train adapters")])
def test_bench_step_bad_lora_is_one_error_line(args: list[str], words: str) -> None:
    r = cli("bench", "step", "--device", "cpu", *args, timeout=120)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_bench_step_cpu_with_a_length_mix(tmp_path) -> None:
    """``--lengths lognormal``: each request's max_new_tokens drawn from the mix (the tiny random model rarely
    samples EOS); the static batch of a step runs as long as its longest response, so its decode steps are not
    full; the JSON reports the percentiles, the critical path and the occupancy of the timed steps."""
    r = cli("bench", "step", "--device", "cpu", "--shape", "qwen3-tiny", "--steps", "2", "--warmup-steps", "1",
            "--prompts", "3", "--samples", "2", "--lengths", "lognormal:mean=8,sigma=1.0,cap=24",
            "--micro-batch-tokens", "512", "--peers", "none", "--cache", str(tmp_path / "cache"), "--json",
            timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["lengths"] == "lognormal:mean=8,sigma=1,cap=24" and "24 new tokens at most" in res["batch"]
    assert 1 <= res["response_length_p50"] <= res["response_length_p99"] <= res["critical_path_tokens"] <= 24
    assert res["response_tokens_mean"] < res["critical_path_tokens"]
    assert 0 < res["decode_occupancy"] < 1 and res["generation_tokens_per_s"] > 0
