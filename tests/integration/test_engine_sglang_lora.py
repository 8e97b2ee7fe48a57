"""The ``sglang`` engine of a LoRA run against the SGLang 0.5.10 stand-in (tests/helpers/sglang_standin.py, strict
fields): started with LoRA enabled, each adapter version loaded by path under its version's name
(``/load_lora_adapter``), requests naming it in ``lora_path`` (tokens and log-probs as PEFT computes them, the
version of the adapter on every token), versions beyond ``max_staleness + 1`` unloaded (``/unload_lora_adapter``),
and the stand-in's LoRA refusals as SGLang words them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from relax_hpc.rollout.engine import GenerateRequest, SamplingParams, SnapshotFolder
from relax_hpc.rundir import RunDir
from tests.helpers.server_util import TINY, hf_greedy, hf_model, publish_adapter, recompute_logprobs

pytestmark = [pytest.mark.integration]

STANDIN = Path(__file__).resolve().parents[1] / "helpers" / "sglang_standin.py"
PROMPT = [1, 5, 6, 7, 17]  # <bos> 1 2 3 =
LORA = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.fixture(scope="module")
def served(tmp_path_factory, loop):
    from relax_hpc.config.load import validate_dict
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.rollout.server import make_server_engine

    rd = RunDir.create(tmp_path_factory.mktemp("sglang-lora") / "run")
    cfg = validate_dict({
        "name": "lora", "mode": "fully_async", "max_staleness": 1,
        "model": {"path": "tiny", "tiny": TINY, "dtype": "float32", "lora": LORA},
        "data": {"task": {"name": "reverse_digits", "min_len": 2, "max_len": 4, "num_prompts": 64},
                 "max_prompt_tokens": 16},
        "rollout": {"engine": "sglang", "sampling": {"temperature": 1.0, "max_new_tokens": 64},
                    "server": {"command": f"{sys.executable} {STANDIN}", "startup_timeout_s": 120, "stop_grace_s": 5,
                               "sync_timeout_s": 30, "env": {"PYTHONPATH": os.getcwd(),
                                                             "SGLANG_STANDIN_STRICT": "1"}}},
    })
    tok = build_digits_tokenizer()
    engine = make_server_engine(cfg, run_dir=rd, proc="rollout-0", device="cpu", seed=0, tokenizer=tok)
    loop.run(engine.ensure_started(), timeout=120)
    yield engine, rd, cfg, tok
    loop.run(engine.close(), timeout=60)


def _greedy(loop, engine, rid: str, n: int = 16):
    req = GenerateRequest(request_id=rid, prompt_ids=PROMPT, sampling=SamplingParams(temperature=0.0,
                                                                                   max_new_tokens=n))
    return loop.run(engine.generate(req), timeout=120).samples[0]


def test_adapter_versions_load_by_path_and_requests_name_them(served, loop):
    engine, rd, cfg, tok = served
    argv = engine.server.spec.argv
    assert "--enable-lora" in argv and argv[argv.index("--max-loras-per-batch") + 1] == "2"
    base = _greedy(loop, engine, "b0")
    assert base.token_ids.tolist() == hf_greedy(hf_model(folder=engine.setup.model_dir), PROMPT, 16,
                                                tok.eos_token_id)
    folder, peft = publish_adapter(rd, engine.setup.model_dir, cfg.model.lora, 1, seed=1)
    want = hf_greedy(peft, PROMPT, 16, tok.eos_token_id)
    assert want != base.token_ids.tolist(), "the adapter should change the greedy output"
    loop.run(engine.receive(1, SnapshotFolder(folder)))
    assert engine.loaded == ["v000001"] and engine.adapter_fields() == {"lora_path": "v000001"}
    got = _greedy(loop, engine, "a1")
    assert got.token_ids.tolist() == want and (got.versions == 1).all()
    np.testing.assert_allclose(got.logprobs, recompute_logprobs(peft, PROMPT, want, 0.0), atol=1e-5)
    for v in (2, 3):
        folder, peft = publish_adapter(rd, engine.setup.model_dir, cfg.model.lora, v, seed=v)
        loop.run(engine.receive(v, SnapshotFolder(folder)))
    assert engine.loaded == ["v000002", "v000003"]
    got = _greedy(loop, engine, "a3")
    assert got.token_ids.tolist() == hf_greedy(peft, PROMPT, 16, tok.eos_token_id) and (got.versions == 3).all()
    with httpx.Client(timeout=30) as c:  # v000001 is gone from the server: unloading it again is refused
        r = c.post(engine.url + "/unload_lora_adapter", json={"lora_name": "v000001"})
        assert r.status_code == 400 and "does not exist" in r.json()["error_message"]


def test_standin_refuses_lora_requests_as_sglang_does(served, loop):
    engine, rd, cfg, _ = served
    with httpx.Client(timeout=30) as c:
        r = c.post(engine.url + "/generate", json={"input_ids": PROMPT, "lora_path": "never",
                                                   "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400 and "never been loaded" in r.json()["error"]["message"]
        folder, _ = publish_adapter(rd, engine.setup.model_dir, cfg.model.lora.model_copy(update={"rank": 16}), 9, 9)
        r = c.post(engine.url + "/load_lora_adapter", json={"lora_name": "wide", "lora_path": str(folder)})
        assert r.status_code == 400 and "--max-lora-rank" in r.json()["error_message"]
        r = c.post(engine.url + "/load_lora_adapter", json={"lora_name": "v000003", "lora_path": str(folder)})
        assert r.status_code == 400 and "already loaded" in r.json()["error_message"]
        r = c.post(engine.url + "/load_lora_adapter", json={"lora_name": "x"})
        assert r.status_code == 400 and "lora_path" in r.json()["error"]["message"]
