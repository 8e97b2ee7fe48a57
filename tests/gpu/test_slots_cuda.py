"""The slot pool on a CUDA GPU (rollout/slots.py): its decode steps captured as CUDA graphs and replayed while
requests come and go; float32 greedy tokens equal the plain loop's, and each seeded request decoded beside others
gives the tokens it gives alone; bf16 runs, stops and records log-probs. Marked ``gpu``: skipped without a GPU (the
CPU suite, tests/unit/test_slots.py, checks the same properties eagerly)."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from relax_hpc.config.schema import SamplingConfig  # noqa: E402
from relax_hpc.rollout import decode  # noqa: E402
from relax_hpc.rollout.engine import GenerateRequest, SamplingParams, generate_all  # noqa: E402
from relax_hpc.rollout.hf_engine import HFEngine  # noqa: E402
from tests.helpers.tinymodel import VOCAB, tiny_model  # noqa: E402


def engine(model: torch.nn.Module, slots: int = 6) -> HFEngine:
    tok = SimpleNamespace(eos_token_id=VOCAB, pad_token_id=0)
    return HFEngine(model, tok, SamplingConfig(), device="cuda", threads=1, slots=slots)


def requests(seeded: bool) -> list[GenerateRequest]:
    rng = np.random.default_rng(5)
    out = []
    for i in range(10):
        prompt = [int(t) for t in rng.integers(1, VOCAB, size=int(rng.integers(2, 9)))]
        s = SamplingParams(n=int(rng.integers(1, 4)), temperature=0.9 if seeded else 0.0, top_k=6 if i % 2 else 0,
                           max_new_tokens=int(rng.integers(5, 90)), seed=100 + i if seeded else None)
        out.append(GenerateRequest(f"c{i}", prompt, s))
    return out


def run_all(eng: HFEngine, reqs: list[GenerateRequest]) -> list:
    return asyncio.run(generate_all(eng, reqs))


def test_graphs_replayed_and_greedy_equals_the_plain_loop() -> None:
    model = tiny_model().cuda()
    eng = engine(model)
    try:
        out = run_all(eng, requests(seeded=False))
        again = run_all(eng, requests(seeded=False))
        pool = eng._pool
    finally:
        eng.shutdown()
    assert pool.use_graphs and pool.captures > 0
    same = []
    for r, req in zip(out, requests(seeded=False)):
        ids = torch.tensor([list(req.prompt_ids)], device="cuda")
        toks, lps = decode.sample(model, ids, torch.ones_like(ids), n=1, max_new_tokens=req.sampling.max_new_tokens,
                                  temperature=0.0, top_k=0, top_p=1.0, eos_id=VOCAB, pad_id=0)
        for s in r.samples:
            assert len(s.token_ids) == req.sampling.max_new_tokens
            same.append(s.token_ids.tolist() == toks[0].tolist())
            if same[-1]:
                np.testing.assert_allclose(s.logprobs, lps[0].cpu().numpy(), rtol=1e-4, atol=1e-4)
    assert sum(same) >= 0.9 * len(same), same  # float32 GPU kernels of two loops may flip a near-tie
    assert [s.token_ids.tolist() for r in again for s in r.samples] == [
        s.token_ids.tolist() for r in out for s in r.samples]


def test_seeded_requests_pooled_equal_alone_on_cuda() -> None:
    model = tiny_model().cuda()
    pooled, alone = engine(model), engine(model)
    try:
        a = run_all(pooled, requests(seeded=True))
        b = [run_all(alone, [r])[0] for r in requests(seeded=True)]
    finally:
        pooled.shutdown()
        alone.shutdown()
    same = [x.token_ids.tolist() == y.token_ids.tolist() for ra, rb in zip(a, b)
            for x, y in zip(ra.samples, rb.samples)]
    assert sum(same) >= 0.9 * len(same), same  # float32 kernels of other batch shapes may flip a near-tie


def test_bf16_pool_runs_and_stops() -> None:
    model = copy.deepcopy(tiny_model()).cuda().to(torch.bfloat16)
    eng = engine(model, slots=4)
    try:
        out = run_all(eng, requests(seeded=True))
    finally:
        eng.shutdown()
    for r, req in zip(out, requests(seeded=True)):
        for s in r.samples:
            assert len(s.token_ids) == req.sampling.max_new_tokens and bool(np.isfinite(s.logprobs).all())
            assert (s.logprobs <= 0).all() and s.token_ids.max() < VOCAB
