"""``relax-hpc bench step`` end to end on the CPU (the tiny shape with the real Qwen vocabulary, one timed step,
transformers.generate as the peer): exit 0 and every figure present and sane; bad input gets one error line."""

from __future__ import annotations

import json

import pytest

from tests.helpers.runutil import cli


@pytest.mark.slow
def test_bench_step_cpu_json(tmp_path) -> None:
    r = cli("bench", "step", "--device", "cpu", "--shape", "qwen3-tiny", "--steps", "1", "--warmup-steps", "1",
            "--prompts", "2", "--samples", "2", "--new-tokens", "4", "--micro-batch-tokens", "512",
            "--peers", "generate", "--cache", str(tmp_path / "cache"), "--profile", str(tmp_path / "prof"), "--json",
            timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["steps"] == 2 and len(res["per_step"]) == 2
    for k in ("step_s", "step_s_steady", "generate_s", "train_s", "hand_over_s", "generation_tokens_per_s",
              "train_tokens_per_s", "train_mfu", "generation_hbm_bound_s", "generation_vs_hbm_bound",
              "generate_static_tokens_per_s"):
        assert isinstance(res[k], float) and res[k] > 0, k
    assert res["response_tokens_mean"] <= 4 and res["prompt_tokens_mean"] > 10  # chat template + system prompt
    assert 0 < res["hand_over_share_of_step"] < 1
    assert (tmp_path / "cache" / "qwen-vocab" / "tokenizer.json").is_file()
    prof = res["profile"]  # --profile: one generation call and one training step under torch.profiler
    assert prof["decode_ms_per_step"] > 0 and prof["profiled_train_step_s"] > 0
    for table in ("decode_profile.txt", "train_profile.txt"):
        assert "Self CPU" in (tmp_path / "prof" / table).read_text()


def test_bench_step_cuda_without_a_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = cli("bench", "step", "--device", "cuda", "--peers", "none", timeout=120)
    assert r.returncode == 2 and "no CUDA GPU" in r.stderr and "Traceback" not in r.stderr
