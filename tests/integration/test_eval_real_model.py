"""Held-out evaluation and the train/rollout mismatch with a real pretrained model (SmolLM2-135M-Instruct, float32
on the CPU): skips where tools/real_model.py has not built it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from relax_hpc.config.load import load_recipe
from tests.helpers.realmodel import real_model_dir
from tests.helpers.runutil import REPO

RECIPE = REPO / "recipes" / "smollm2-135m-arithmetic.yaml"


@pytest.mark.integration
def test_real_model_eval_and_float32_mismatch(tmp_path: Path) -> None:
    folder = real_model_dir("float32")
    cfg = load_recipe(RECIPE, [f"model.path={folder}", "eval.max_prompts=4", "eval.sampling.max_new_tokens=10",
                               "eval.pass_k=[1]"])
    from relax_hpc.algorithms.mismatch import MismatchMeter, mismatch_metrics
    from relax_hpc.eval.evaluator import Evaluator
    from relax_hpc.models.load import load_model, load_tokenizer
    from relax_hpc.rollout.engine import GenerateRequest, SamplingParams
    from relax_hpc.rollout.factory import make_engine

    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, device="cpu", dtype=torch.float32)
    engine = make_engine(cfg, device="cpu", seed=0, tokenizer=tok, model=model)
    loop = asyncio.new_event_loop()
    try:
        ev = Evaluator(cfg, tok)
        assert len(ev.heldout.prompts) == 4 and ev.heldout.prompts[0].raw.endswith(" =")
        first = ev.evaluate(engine, 0, loop.run_until_complete)
        again = ev.evaluate(engine, 0, loop.run_until_complete)  # greedy: the same responses
        assert [s["response"] for s in first.samples] == [s["response"] for s in again.samples]
        m = first.metrics
        assert m["eval/samples"] == 4 and 0.0 <= m["eval/accuracy"] <= 1.0
        assert m["eval/accuracy"] == pytest.approx(sum(s["reward"] for s in first.samples) / 4)
        assert set(k for k in m if k.startswith("eval/accuracy/")) <= {"eval/accuracy/carry", "eval/accuracy/no_carry"}
        assert any(s["response"].strip() for s in first.samples)  # a real model says something
        # the engine's sampling log-probs (temperature 1) against the model's own forward pass of the same tokens
        p = ev.heldout.prompts[0]
        res = loop.run_until_complete(engine.generate(GenerateRequest(
            "mm", p.prompt_ids, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3))))
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
    meter = MismatchMeter(2.0)
    with torch.no_grad():
        for s in res.samples:
            ids = torch.tensor([list(p.prompt_ids) + s.token_ids.tolist()])
            logits = model(ids).logits[0, len(p.prompt_ids) - 1:-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(p.prompt_ids):, None])[:, 0]
            n = len(s.token_ids)
            meter.add(lp, torch.from_numpy(s.logprobs), torch.ones(n), torch.zeros(n, dtype=torch.long), [0])
    mm = mismatch_metrics(meter.sums(), meter.maxima())
    assert mm["train/mismatch_kl"] <= 1e-6, mm
