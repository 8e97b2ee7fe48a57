"""The static-cache decode loop (rollout/graph_decode.py) against the plain loop (rollout/decode.py) on a real tiny
Qwen3: on the CPU the same sampled tokens for the same seed (greedy, temperature, top-k, top-p), the same log-probs,
EOS and padding alike; the bucket compaction the GPU path uses keeps greedy results; the state is reused between calls.
On a GPU (marked ``gpu``): CUDA graphs captured and replayed, greedy tokens and log-probs against the plain loop."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from relax_hpc.rollout import decode
from relax_hpc.rollout.graph_decode import GraphDecoder, buckets, supported

VOCAB, EOS, PAD = 12, 3, 0


def make_model(vocab: int = VOCAB, std: float = 0.6, layers: int = 2) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=512,
                      tie_word_embeddings=True)
    m = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # large weights: outputs that depend on the prompt and the position
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
    return m


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_model()


def left_pad(ps: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in ps)
    ids = torch.full((len(ps), width), PAD, dtype=torch.long)
    attn = torch.zeros((len(ps), width), dtype=torch.long)
    for i, p in enumerate(ps):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    return ids, attn


def prompts(vocab: int = VOCAB) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [list(rng.integers(4, vocab, size=k)) for k in (3, 5, 2, 6, 4)]


def trimmed(toks: torch.Tensor, lps: torch.Tensor) -> list[tuple[list[int], np.ndarray]]:
    """Each row up to and including its first EOS (the rest is padding)."""
    out = []
    for row, lp in zip(toks.tolist(), lps.numpy()):
        end = row.index(EOS) + 1 if EOS in row else len(row)
        out.append((row[:end], lp[:end]))
    return out


def both(model: torch.nn.Module, dec: GraphDecoder, seed: int, **kw: object):
    ids, attn = left_pad(prompts())
    torch.manual_seed(seed)
    a = decode.sample(model, ids, attn, eos_id=EOS, pad_id=PAD, **kw)
    torch.manual_seed(seed)
    b = dec.sample(ids, attn, eos_id=EOS, pad_id=PAD, **kw)
    return a, b


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.0, "top_k": 0, "top_p": 1.0},
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
    {"temperature": 0.7, "top_k": 5, "top_p": 1.0},
    {"temperature": 1.3, "top_k": 0, "top_p": 0.8},
    {"temperature": 0.9, "top_k": 6, "top_p": 0.9},
], ids=["greedy", "t1", "topk", "topp", "both"])
def test_same_tokens_as_the_plain_loop_on_cpu(model: torch.nn.Module, sampling: dict[str, float]) -> None:
    assert supported(model)
    dec = GraphDecoder(model)
    assert not dec.use_graphs and not dec.compact and dec.check_every == 1
    stops = set()
    for seed in (0, 1):
        (ta, la), (tb, lb) = both(model, dec, seed, n=4, max_new_tokens=40, **sampling)
        assert ta.shape == tb.shape  # the same number of steps: every row done at the same token
        ra, rb = trimmed(ta, la), trimmed(tb, lb)
        assert [r[0] for r in ra] == [r[0] for r in rb]
        for (_, x), (_, y) in zip(ra, rb):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
        stops |= {EOS in r[0] for r in ra}
    if sampling["temperature"] > 0:
        assert stops == {True, False}, "rows that stop early and rows that run to the limit"


@pytest.mark.slow
def test_compiled_layer_parts_give_the_plain_loops_tokens_on_cpu(model: torch.nn.Module) -> None:
    """``rollout.hf_decoder: compiled``: the two halves of each layer around the attention are compiled (inductor's
    C++ backend on the CPU): the same sampled tokens for the same seed, log-probs within 1e-5."""
    torch._dynamo.reset()
    dec = GraphDecoder(model, compiled=True)
    for sampling in ({"temperature": 0.0, "top_k": 0, "top_p": 1.0}, {"temperature": 0.9, "top_k": 6, "top_p": 0.9}):
        (ta, la), (tb, lb) = both(model, dec, 0, n=3, max_new_tokens=24, **sampling)
        ra, rb = trimmed(ta, la), trimmed(tb, lb)
        assert [r[0] for r in ra] == [r[0] for r in rb]
        for (_, x), (_, y) in zip(ra, rb):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    assert not dec._pre.failed and not dec._post.failed


def test_several_steps_between_checks_same_tokens(model: torch.nn.Module) -> None:
    """The GPU path runs the steps between two stop checks as one unit: eagerly, the same sampled tokens."""
    dec = GraphDecoder(model, check_every=4)
    kw = {"temperature": 0.9, "top_k": 6, "top_p": 0.9}
    for seed in (0, 1):
        (ta, la), (tb, lb) = both(model, dec, seed, n=3, max_new_tokens=30, **kw)
        assert tb.shape[1] >= ta.shape[1] and tb.shape[1] % 4 in (0, 30 % 4)
        ra, rb = trimmed(ta, la), trimmed(tb, lb)
        assert [r[0] for r in ra] == [r[0] for r in rb]
        for (_, x), (_, y) in zip(ra, rb):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)


def test_compaction_keeps_greedy_results(model: torch.nn.Module) -> None:
    """The GPU path's bucket compaction (finished rows drop out, the others move to the front with their caches),
    run eagerly: the same greedy tokens as the plain loop, rows back in their order."""
    hot = copy.deepcopy(model)
    with torch.no_grad():  # a peaked EOS logit at some positions: rows finish at different steps
        hot.lm_head.weight[EOS] *= 1.6
    dec = GraphDecoder(hot, compact=True, check_every=2)
    ids, attn = left_pad(prompts())
    ta, la = decode.sample(hot, ids, attn, n=3, max_new_tokens=60, temperature=0.0, top_k=0, top_p=1.0,
                           eos_id=EOS, pad_id=PAD)
    tb, lb = dec.sample(ids, attn, n=3, max_new_tokens=60, temperature=0.0, top_k=0, top_p=1.0,
                        eos_id=EOS, pad_id=PAD)
    ra, rb = trimmed(ta, la), trimmed(tb, lb)
    lengths = [len(r[0]) for r in ra]
    assert len(set(lengths)) > 2, lengths  # rows finish at several different steps
    assert [r[0] for r in ra] == [r[0] for r in rb]
    for (_, x), (_, y) in zip(ra, rb):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)
    assert tb.shape[1] <= ta.shape[1] + 1  # stops within check_every of the plain loop


def test_state_reused_and_reallocated(model: torch.nn.Module) -> None:
    dec = GraphDecoder(model)
    kw = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    both(model, dec, 0, n=2, max_new_tokens=10, **kw)
    k0 = dec.k[0]
    (ta, _), (tb, _) = both(model, dec, 0, n=2, max_new_tokens=12, **kw)  # fits: same buffers
    assert dec.k[0] is k0 and torch.equal(ta, tb[:, :ta.shape[1]])
    (ta, _), (tb, _) = both(model, dec, 0, n=3, max_new_tokens=10, **kw)  # more rows: new buffers
    assert dec.k[0] is not k0 and dec.rows == 15 and torch.equal(ta, tb[:, :ta.shape[1]])


def test_buckets() -> None:
    assert buckets(128) == [128, 64, 32, 16, 8, 4, 2, 1]
    assert buckets(40) == [40, 32, 16, 8, 4, 2, 1]
    assert buckets(1) == [1]


def test_unsupported_models() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    assert not supported(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=20)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-layers", "compiled-layers"])
def test_cuda_graphs_agree_with_the_plain_loop_in_bf16(compiled: bool) -> None:
    """bf16 on a GPU, graphs and compaction on (and ``compiled``: the layers' elementwise work fused by
    torch.compile inside the graphs): greedy tokens agree with the plain loop (a position where the two differ must
    be a near-tie of the top two logits), log-probs within bf16 tolerance, sampling runs and stops."""
    model = make_model(vocab=64, std=0.3, layers=3).cuda().to(torch.bfloat16)
    dec = GraphDecoder(model, compiled=compiled)
    assert dec.use_graphs and dec.compact
    ids, attn = left_pad(prompts(64))
    ids, attn = ids.cuda(), attn.cuda()
    kw = {"n": 4, "max_new_tokens": 40, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "eos_id": EOS, "pad_id": PAD}
    ta, la = decode.sample(model, ids, attn, **kw)
    tb, lb = dec.sample(ids, attn, **kw)
    assert dec.captures > 0
    w = min(ta.shape[1], tb.shape[1])
    same = (ta[:, :w] == tb[:, :w]).float().mean().item()
    first = (ta[:, :8] == tb[:, :8]).float().mean().item()
    assert first >= 0.95 and same >= 0.8, (first, same)
    agree = ta[:, :w] == tb[:, :w]
    eos = (ta[:, :w] == EOS).int()
    response = (eos.cumsum(dim=1) - eos) == 0  # up to and including the first EOS (the rest is padding)
    prefix = agree.cumprod(dim=1).bool() & response  # response positions before a row's first disagreement
    diff = (la[:, :w] - lb[:, :w]).abs()[prefix]
    assert diff.max().item() < 0.1 and diff.mean().item() < 0.02, (diff.max().item(), diff.mean().item())
    # sampling with top-k/top-p inside the graph: valid tokens, finite log-probs, second call replays
    torch.manual_seed(0)
    kw.update(temperature=0.9, top_k=20, top_p=0.9)
    n_graphs = dec.captures
    for _ in range(2):
        toks, lps = dec.sample(ids, attn, **kw)
        assert int(toks.max()) < 64 and bool(torch.isfinite(lps).all()) and bool((lps <= 0).all())
    assert dec.captures > n_graphs
    again = dec.captures
    dec.sample(ids, attn, **kw)
    assert dec.captures == again  # same size and sampling: all steps replayed
    if compiled:
        assert not dec._pre.failed and not dec._post.failed
