"""The ``hf`` engine's sampling loop against ``transformers.generate`` on a real (tiny, random) Qwen3 model: the same
tokens for the same seed (greedy and sampled, with temperature, top-k and top-p), the same log-probs, EOS and
padding handled alike; and the engine picks ``generate`` where the loop does not apply."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from relax_hpc.config.schema import SamplingConfig
from relax_hpc.rollout.decode import loop_supported, sample
from relax_hpc.rollout.engine import GenerateRequest, GenerateResult, generate_all
from relax_hpc.rollout.hf_engine import HFEngine
from tests.helpers.runutil import cli

VOCAB, EOS, PAD = 12, 3, 0


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64,
                      tie_word_embeddings=True)
    m = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # large weights: outputs that depend on the prompt and the position
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.6)
    return m


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [list(rng.integers(4, VOCAB, size=k)) for k in (3, 5, 2, 6, 4)]  # varied lengths: left padding


def left_pad(ps: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in ps)
    ids = torch.full((len(ps), width), PAD, dtype=torch.long)
    attn = torch.zeros((len(ps), width), dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    return ids, attn


def engine(model: torch.nn.Module, decoder: str, device: str = "cpu", seed: int = 0, **sampling: object) -> HFEngine:
    tok = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
    return HFEngine(model, tok, SamplingConfig(**sampling), batch_prompts=8, decoder=decoder, device=device,
                    seed=seed)


def generate(eng: HFEngine, n: int) -> list[GenerateResult]:
    """The five prompts as concurrent requests (one batch), then the engine's thread is stopped."""
    reqs = [GenerateRequest(f"p{i}", p, replace(eng.sampling, n=n)) for i, p in enumerate(prompts())]

    async def go() -> list[GenerateResult]:
        try:
            return await generate_all(eng, reqs)
        finally:
            await eng.close()
    return asyncio.run(go())


def completions(model: torch.nn.Module, decoder: str, seed: int, n: int, device: str = "cpu",
                **sampling: object) -> tuple[HFEngine, list[tuple[list[int], np.ndarray, str]]]:
    """A fresh engine seeded with ``seed``: its first batch's samples."""
    eng = engine(model, decoder, device, seed, **sampling)
    out = generate(eng, n)
    return eng, [(c.token_ids.tolist(), c.logprobs, c.finish_reason) for r in out for c in r.samples]


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 0.9, "top_k": 6, "top_p": 0.9},
], ids=["greedy", "t1", "topk", "topp", "both"])
def test_loop_samples_exactly_as_generate(model: torch.nn.Module, sampling: dict[str, float]) -> None:
    for seed in (0, 1):
        loop, a = completions(model, "auto", seed, 4, max_new_tokens=10, **sampling)
        gen, b = completions(model, "generate", seed, 4, max_new_tokens=10, **sampling)
        assert loop._loop is True and gen._loop is False
        assert [x[0] for x in a] == [x[0] for x in b]
        assert [x[2] for x in a] == [x[2] for x in b]
        for (_, lp_a, _), (_, lp_b, _) in zip(a, b):
            np.testing.assert_allclose(lp_a, lp_b, rtol=1e-5, atol=1e-5)
    reasons = {x[2] for x in a}
    if sampling["temperature"] > 0:  # the test covers rows that stop early and rows that run to the limit
        assert reasons == {"stop", "length"}, reasons


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_loop_samples_exactly_as_generate_on_cuda(model: torch.nn.Module) -> None:
    import copy

    gpu = copy.deepcopy(model).cuda()
    for sampling in ({"temperature": 0.0}, {"temperature": 0.9, "top_k": 6, "top_p": 0.9}):
        loop, a = completions(gpu, "auto", 0, 4, "cuda", max_new_tokens=10, **sampling)
        _, b = completions(gpu, "generate", 0, 4, "cuda", max_new_tokens=10, **sampling)
        assert loop._loop is True
        assert [x[0] for x in a] == [x[0] for x in b]
        for (_, lp_a, _), (_, lp_b, _) in zip(a, b):
            np.testing.assert_allclose(lp_a, lp_b, rtol=1e-4, atol=1e-4)


def test_own_masks_give_the_models_own_masking_bit_for_bit(model: torch.nn.Module,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop hands an SDPA model ready 4-D masks (left padding: padding queries attend only to themselves, so no
    NaN row reaches the next layer); the tokens and log-probs equal those of the model's own mask building from
    the 2-D mask, for greedy and sampled decoding."""
    import relax_hpc.rollout.decode as decode

    assert decode.own_masks(model), "the suite's Qwen3 model runs SDPA over full attention: the loop's own masks"
    ids, attn = left_pad(prompts())
    assert not bool(attn.all()), "the prompts must be left-padded"
    mask = decode.prompt_mask(attn)  # models/masks.py
    assert mask.shape == (5, 1, ids.shape[1], ids.shape[1]) and bool(mask.any(-1).all())
    for temperature in (0.0, 1.0):
        runs = []
        for own in (True, False):
            monkeypatch.setattr(decode, "own_masks", lambda m, own=own: own)
            g = torch.Generator().manual_seed(5)
            runs.append(sample(model, ids, attn, n=3, max_new_tokens=12, temperature=temperature, top_k=0,
                               top_p=1.0, eos_id=EOS, pad_id=PAD, generator=g))
        (t_own, lp_own), (t_hf, lp_hf) = runs
        assert torch.equal(t_own, t_hf) and bool(torch.isfinite(lp_own).all())
        torch.testing.assert_close(lp_own, lp_hf, rtol=0, atol=1e-6)


def test_own_masks_only_for_sdpa_over_full_attention() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from relax_hpc.models.masks import own_masks

    base = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, intermediate_size=64, max_position_embeddings=64)
    assert own_masks(Qwen3ForCausalLM(Qwen3Config(**base, attn_implementation="sdpa")))
    assert not own_masks(Qwen3ForCausalLM(Qwen3Config(**base, attn_implementation="eager")))
    windowed = Qwen3ForCausalLM(Qwen3Config(**base, use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                            attn_implementation="sdpa"))
    assert not own_masks(windowed), "a sliding window needs the model's own per-layer masks"

def test_sample_pads_finished_rows_and_stops_when_all_are_done(model: torch.nn.Module) -> None:
    ids, attn = left_pad(prompts())
    torch.manual_seed(3)
    # a high temperature: every token about 1/12 likely, so every row meets EOS long before 150 tokens
    toks, lps = sample(model, ids, attn, n=6, max_new_tokens=150, temperature=50.0, top_k=0, top_p=1.0,
                       eos_id=EOS, pad_id=PAD)
    assert toks.shape == lps.shape and toks.shape[0] == 5 * 6
    assert toks.shape[1] < 150, "generation should stop once every row has produced EOS"
    for row in toks.tolist():
        first = row.index(EOS)  # every row ends on EOS...
        assert all(t == PAD for t in row[first + 1:])  # ...and is padded after it
    assert lps.dtype == torch.float32 and bool((lps <= 0).all())


def test_engine_uses_generate_where_the_loop_does_not_apply(model: torch.nn.Module) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vl = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config={"vocab_size": 32, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "intermediate_size": 32},
        vision_config={"depth": 1, "hidden_size": 16, "out_hidden_size": 32, "num_heads": 2,
                       "intermediate_size": 16}))
    assert loop_supported(model) and not loop_supported(vl)
    stop = engine(model, "auto", max_new_tokens=4, stop=["x"])
    calls: list[int] = []

    def spy(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise RuntimeError("generate called")
    stop._hf_generate = spy  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="generate called"):
        generate(stop, 2)
    assert calls and stop._loop is True  # the model supports the loop, but stop strings go to generate


def test_bench_generate_json() -> None:
    r = cli("bench", "generate", "--json", "--batches", "3", "--warmup", "1", "--set", "rollout.batch_prompts=4",
            "--set", "rollout.n_samples=2", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["loop_used"] is True and res["batches"] == 3 and res["device"] == "cpu"
    assert res["speedup"] == pytest.approx(res["generate_ms_median"] / res["loop_ms_median"])
    for name in ("loop", "generate"):
        assert 0 < res[f"{name}_ms_min"] <= res[f"{name}_ms_median"]
        assert 1 <= res[f"{name}_response_tokens_mean"] <= 8  # the demo's max_new_tokens
    bad = cli("bench", "generate", "--set", "rollout.n_samples=0", timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "Traceback" not in bad.stderr
