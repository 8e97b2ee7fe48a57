"""The ``sglang`` engine runs the engine conformance suite against the SGLang stand-in
(``tests/helpers/sglang_standin.py``:
SGLang cannot run on these machines, see test_engine_sglang.py), started with ``--enable-deterministic-inference``
(SGLang honours a request's seed only then; the suite checks seeded reproducibility). The suite's model is saved as
the server's HF folder with no EOS (the suite needs samples that end only by length, stop tokens or abort)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from relax_hpc.config.schema import ServerConfig
from relax_hpc.rollout.server.base import ServerSetup
from relax_hpc.rollout.server.sglang import SGLangEngine
from relax_hpc.rundir import RunDir
from tests.helpers.engine_conformance import *  # noqa: F403 - the suite's tests run here
from tests.helpers.engine_conformance import Harness

pytestmark = [pytest.mark.integration]

STANDIN = Path(__file__).parents[1] / "helpers" / "sglang_standin.py"
VOCAB = 24


def tiny_model() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=2048,
                      tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    m = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return m


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    model = tiny_model()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    conf = json.loads((folder / "config.json").read_text())
    assert conf.get("eos_token_id") is None
    rd = RunDir.create(tmp_path / "run")
    cfg = ServerConfig(command=f"{sys.executable} {STANDIN}", env={"PYTHONPATH": os.getcwd()}, stop_grace_s=3,
                       startup_timeout_s=120, sync_timeout_s=60)
    setup = ServerSetup(name="rollout-0-0", model_dir=folder, record=rd.server_record("rollout-0-0"),
                        log=rd.server_log("rollout-0-0"), views=rd.server_views("rollout-0-0"), device="cpu",
                        max_model_len=2048,  # seeded requests need SGLang's deterministic inference
                        extra_server_args={"enable_deterministic_inference": True})
    engine = SGLangEngine(cfg, setup)
    asyncio.run(engine.ensure_started())
    try:
        yield Harness(engine=engine, model=model, run_dir=rd, vocab=VOCAB)
    finally:
        asyncio.run(engine.close())
