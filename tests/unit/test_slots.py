"""The ``hf`` engine's slot pool (rollout/slots.py) on a real tiny Qwen3: each request's tokens equal those of the
same request decoded alone, greedy and sampled with a per-request seed, while more rows than slots come and go; the
pool's greedy tokens equal the plain loop's on a model that samples EOS; a request that arrives while a long one
decodes takes a free slot at once; the per-row draw follows the sampling distribution; decode occupancy."""

from __future__ import annotations

import asyncio
import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from relax_hpc.config.schema import SamplingConfig
from relax_hpc.rollout import decode
from relax_hpc.rollout.engine import GenerateRequest, GenerateResult, SamplingParams, generate_all
from relax_hpc.rollout.hf_engine import HFEngine
from relax_hpc.rollout.slots import Occupancy, SlotPool, row_key, uniforms
from tests.helpers.tinymodel import VOCAB, tiny_model

SLOTS = 5


def engine(model: torch.nn.Module, slots: int = SLOTS, eos: int = VOCAB, seed: int = 0) -> HFEngine:
    tok = SimpleNamespace(eos_token_id=eos, pad_token_id=0)
    return HFEngine(model, tok, SamplingConfig(), threads=1, slots=slots, seed=seed, batch_prompts=4)


def mixed_requests(vocab: int, seeded: bool) -> list[GenerateRequest]:
    """Twelve requests of varied prompt lengths, budgets, sample counts and settings (27 rows for 5 slots)."""
    rng = np.random.default_rng(3)
    settings = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                dict(temperature=1.2, top_p=0.8), dict(temperature=0.9, top_k=6, top_p=0.9)]
    reqs = []
    for i in range(12):
        prompt = [int(t) for t in rng.integers(1, vocab, size=int(rng.integers(2, 10)))]
        kw: dict = dict(settings[i % len(settings)])
        if seeded or kw["temperature"] == 0:
            kw["seed"] = 1000 + i if kw["temperature"] > 0 else None
        stop = (int(rng.integers(1, vocab)),) if i % 4 == 3 else ()
        reqs.append(GenerateRequest(f"r{i}", prompt, SamplingParams(n=int(rng.integers(1, 4)),
                                                                    max_new_tokens=int(rng.integers(3, 40)),
                                                                    stop_token_ids=stop, **kw)))
    return reqs


def run_all(eng: HFEngine, reqs: list[GenerateRequest]) -> list[GenerateResult]:
    async def go() -> list[GenerateResult]:
        return await generate_all(eng, reqs)
    return asyncio.run(go())


def test_each_request_decoded_in_the_pool_equals_the_request_decoded_alone() -> None:
    model = tiny_model()
    reqs = mixed_requests(VOCAB, seeded=True)
    assert sum(r.sampling.n for r in reqs) > 4 * SLOTS, "slots must be reused several times"
    pooled_eng, alone_eng = engine(model), engine(model)
    try:
        pooled = run_all(pooled_eng, reqs)
        alone = [run_all(alone_eng, [r])[0] for r in reqs]  # one request at a time: nothing else in the pool
        stats = pooled_eng.metrics()
        assert pooled_eng._pool.compactions > 0, "the tail must have run in a smaller bucket"
    finally:
        pooled_eng.shutdown()
        alone_eng.shutdown()
    reasons = set()
    for req, a, b in zip(reqs, pooled, alone):
        assert len(a.samples) == len(b.samples) == req.sampling.n
        for sa, sb in zip(a.samples, b.samples):
            assert sa.token_ids.tolist() == sb.token_ids.tolist(), req.request_id
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, rtol=1e-5, atol=1e-5)
            assert sa.finish_reason == sb.finish_reason
            assert 1 <= len(sa.token_ids) <= req.sampling.max_new_tokens
            reasons.add(sa.finish_reason)
        if req.sampling.temperature > 0 and req.sampling.n > 1:
            assert len({tuple(s.token_ids) for s in a.samples}) > 1, "the samples of a prompt must differ"
    assert reasons == {"stop", "length"}, reasons
    assert 0 < stats["perf/decode_occupancy"] <= 1 and stats["perf/decode_slots"] == SLOTS


def test_unseeded_requests_are_reproducible_from_the_engine_seed() -> None:
    """Without a request seed each request draws one from the engine's generator in submission order: the same
    engine seed gives the same tokens, another seed others."""
    model = tiny_model()
    reqs = mixed_requests(VOCAB, seeded=False)

    def tokens(seed: int) -> list[list[int]]:
        eng = engine(model, seed=seed)
        try:
            return [s.token_ids.tolist() for r in run_all(eng, reqs) for s in r.samples]
        finally:
            eng.shutdown()

    a, b, c = tokens(5), tokens(5), tokens(6)
    assert a == b and a != c


def test_pool_greedy_tokens_equal_the_plain_loop_with_eos() -> None:
    """A model that samples EOS (rows end at different steps and free their slots): the pool's greedy tokens and
    log-probs equal those of the plain sampling loop for every prompt."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab, eos = 12, 3
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                         max_position_embeddings=512, tie_word_embeddings=True)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.6)
        model.lm_head.weight[eos] *= 1.6  # EOS likely at some positions
    rng = np.random.default_rng(1)
    ps = [[int(t) for t in rng.integers(4, vocab, size=k)] for k in (3, 5, 2, 6, 4, 7, 3, 5)]
    eng = engine(model, slots=3, eos=eos)
    try:
        out = run_all(eng, [GenerateRequest(f"g{i}", p, SamplingParams(temperature=0.0, max_new_tokens=60))
                            for i, p in enumerate(ps)])
    finally:
        eng.shutdown()
    lengths = set()
    for p, r in zip(ps, out):
        ids = torch.tensor([p])
        toks, lps = decode.sample(model, ids, torch.ones_like(ids), n=1, max_new_tokens=60, temperature=0.0, top_k=0,
                                  top_p=1.0, eos_id=eos, pad_id=0)
        row = toks[0].tolist()
        end = row.index(eos) + 1 if eos in row else len(row)
        s = r.samples[0]
        assert s.token_ids.tolist() == row[:end]
        np.testing.assert_allclose(s.logprobs, lps[0, :end].numpy(), rtol=1e-5, atol=1e-5)
        assert s.finish_reason == ("stop" if eos in row else "length")
        lengths.add(len(s.token_ids))
    assert len(lengths) > 2, lengths


def test_a_request_arriving_mid_decode_takes_a_free_slot_at_once() -> None:
    """Static batches make a request that arrives while a batch decodes wait for the whole batch; the pool admits
    it between two runs of decode steps, so it finishes while the long request still runs."""
    eng = engine(tiny_model())

    async def go() -> tuple[bool, GenerateResult, GenerateResult]:
        long = asyncio.ensure_future(eng.generate(GenerateRequest("long", [1, 2, 3], SamplingParams(
            max_new_tokens=1500))))
        await asyncio.sleep(0.3)
        assert not long.done()
        short = await asyncio.wait_for(eng.generate(GenerateRequest("short", [4, 5], SamplingParams(
            max_new_tokens=4))), 60)
        running = not long.done()
        return running, short, await asyncio.wait_for(long, 120)

    try:
        running, short, long = asyncio.run(go())
    finally:
        eng.shutdown()
    assert running, "the short request must end while the long one decodes"
    assert len(short.samples[0].token_ids) == 4 and len(long.samples[0].token_ids) == 1500


def test_pool_keeps_occupancy_above_static_batches_on_a_length_mix() -> None:
    """The same requests with long-tailed budgets: the static batches' decode steps run with most rows idle (a
    batch lasts as long as its longest row), the pool's stay full while requests are queued."""
    model = tiny_model()
    rng = np.random.default_rng(0)
    budgets = np.minimum(rng.lognormal(np.log(12), 1.0, size=24).astype(int) + 1, 120)
    reqs = [GenerateRequest(f"m{i}", [1 + i % 7, 2, 3], SamplingParams(max_new_tokens=int(b)))
            for i, b in enumerate(budgets)]
    static = HFEngine(model, SimpleNamespace(eos_token_id=VOCAB, pad_token_id=0), SamplingConfig(), threads=1,
                      batch_prompts=SLOTS)
    pooled = engine(model)
    try:
        a = run_all(static, reqs)
        b = run_all(pooled, reqs)
        occ_static = static.metrics()["perf/decode_occupancy"]
        occ_pool = pooled.metrics()["perf/decode_occupancy"]
        assert pooled.metrics() == {}, "metrics are taken per window"
    finally:
        static.shutdown()
        pooled.shutdown()
    assert [len(s.token_ids) for r in a for s in r.samples] == budgets.tolist()
    assert [len(s.token_ids) for r in b for s in r.samples] == budgets.tolist()
    assert occ_pool > 0.6 and occ_pool > occ_static + 0.15, (occ_pool, occ_static)


def test_per_row_draw_follows_the_sampling_distribution() -> None:
    """Many rows with one logits vector and distinct keys: the drawn tokens' frequencies match the warped
    distribution (temperature, top-k, top-p as ``decode.warp``); tokens the cut removes are never drawn."""
    model = tiny_model()
    rows = 4096
    pool = SlotPool(model, rows, length=64, pad_id=0)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 6, 1.0), (1.3, 0, 0.7)):
        pool.temp.fill_(temperature)
        pool.top_k.fill_(top_k)
        pool.top_p.fill_(top_p)
        pool.keys.copy_(torch.tensor([row_key(11, j) for j in range(rows)]))
        want = decode.warp(logits[None], temperature=temperature, top_k=top_k, top_p=top_p).softmax(-1)[0]
        counts = torch.zeros(VOCAB)
        for step in range(2):
            pool.gen.fill_(step)
            tok, lp = pool._draw(logits.expand(rows, VOCAB).clone(), slice(None), cut=top_k > 0 or top_p < 1)
            counts += torch.bincount(tok, minlength=VOCAB)
            expect = torch.log_softmax(logits / temperature, -1)[tok]
            torch.testing.assert_close(lp, expect)
        freq = counts / counts.sum()
        assert float(freq[want == 0].sum()) == 0.0
        assert float((freq - want).abs().sum() / 2) < 0.04, (temperature, top_k, top_p)


def test_uniforms_depend_only_on_key_and_index() -> None:
    keys = torch.tensor([row_key(1, 0), row_key(1, 1), row_key(2, 0), row_key(1, 0)])
    idx = torch.tensor([0, 0, 0, 0])
    u = uniforms(keys, idx)
    assert bool(((u > 0) & (u < 1)).all()) and u[0] == u[3] and len(set(u[:3].tolist())) == 3
    many = uniforms(torch.full((20000,), row_key(3, 0)), torch.arange(20000))
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.005


def test_occupancy_of_a_static_batch() -> None:
    occ = Occupancy()
    occ.add_batch(np.array([8, 1, 1, 1, 1, 1, 1, 1]), steps=8, seconds=4.0)
    m = occ.take()
    assert m["perf/decode_occupancy"] == pytest.approx(15 / 64)
    assert m["perf/decode_low_occupancy_time"] == pytest.approx(4.0 * 7 / 8)  # 7 of 8 steps with 1 row of 8
    assert m["perf/decode_steps"] == 8 and occ.take() == {}


def test_engine_on_a_shared_module_keeps_static_batches() -> None:
    """colocate's engine (the trainer's module, no thread of its own) and the ``generate`` decoder get no pool."""
    model = tiny_model()
    tok = SimpleNamespace(eos_token_id=VOCAB, pad_token_id=0)
    shared = HFEngine(model, tok, SamplingConfig(), shared=True, threaded=False, slots=8)
    gen = HFEngine(copy.deepcopy(model), tok, SamplingConfig(), decoder="generate", slots=8, threads=1)
    try:
        assert shared.slots == 0 and gen.slots == 0
    finally:
        shared.shutdown()
        gen.shutdown()


def test_compaction_keeps_every_rows_tokens() -> None:
    """Rows that move to the front of the pool (with their caches and state) when the occupied slots fill at most
    half of their bucket: the same tokens, log-probs and reasons as in a pool that never moves them."""
    from relax_hpc.rollout.slots import RowSpec

    model = tiny_model()
    rng = np.random.default_rng(4)
    specs = [RowSpec([int(t) for t in rng.integers(1, VOCAB, size=int(rng.integers(2, 8)))],
                     int(rng.integers(2, 50)), [0.0, 1.0, 0.8][i % 3], 5 if i % 4 == 1 else 0,
                     0.9 if i % 5 == 2 else 1.0, (VOCAB, 7), row_key(9, i), i, i) for i in range(14)]
    results = []
    for compact in (True, False):
        pool = SlotPool(model, 8, length=64, pad_id=0)
        pool.compact = compact
        queue, done = list(specs), []
        while queue or pool.active:
            free = len(pool.free())
            done += pool.admit(queue[:free])
            queue = queue[free:]
            done += pool.run()
        results.append((sorted(done, key=lambda f: f.tag), pool.compactions))
    (moved, n_moved), (kept, n_kept) = results
    assert n_moved > 0 and n_kept == 0
    for a, b in zip(moved, kept):
        assert a.tag == b.tag and a.tokens.tolist() == b.tokens.tolist() and a.reason == b.reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
    assert {f.reason for f in moved} == {"stop", "length"}


def test_a_request_that_fails_its_prefill_fails_alone() -> None:
    """A prompt the model cannot read (a token id outside the vocabulary) fails its own request; the requests in the
    pool beside it finish, and the engine serves the next ones."""
    eng = engine(tiny_model())

    async def go() -> tuple[GenerateResult, BaseException | None, GenerateResult]:
        ok = asyncio.ensure_future(eng.generate(GenerateRequest("ok", [1, 2, 3], SamplingParams(max_new_tokens=60))))
        await asyncio.sleep(0.2)
        err: BaseException | None = None
        try:
            await asyncio.wait_for(eng.generate(GenerateRequest("bad", [1, VOCAB + 5], SamplingParams(
                max_new_tokens=5))), 60)
        except Exception as exc:
            err = exc
        after = await asyncio.wait_for(eng.generate(GenerateRequest("after", [2, 3], SamplingParams(
            max_new_tokens=3))), 60)
        return await asyncio.wait_for(ok, 60), err, after

    try:
        ok, err, after = asyncio.run(go())
        healthy = asyncio.run(eng.health()).ok
    finally:
        eng.shutdown()
    assert isinstance(err, IndexError), repr(err)
    assert len(ok.samples[0].token_ids) == 60 and ok.samples[0].finish_reason == "length"
    assert len(after.samples[0].token_ids) == 3 and healthy
