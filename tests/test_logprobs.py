"""Chunked log-probs (trainer/logprobs.py) against the full-logits computation: the same values, entropies and
gradients (hidden states, head weight, through the whole model) in float32 on the CPU, with chunks smaller than the
token count, with temperature, and through TorchTrainer (the loss and every parameter gradient of one step)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from relax_hpc.trainer.logprobs import chunked_logprobs, chunked_supported, response_logprobs


def reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = (hidden @ weight.t()).float() / temperature
    lp_all = torch.log_softmax(logits, dim=-1)
    logp = lp_all.gather(-1, targets[:, None])[:, 0]
    ent = -(lp_all.exp() * lp_all).sum(-1)
    return logp, ent


@pytest.mark.parametrize(("chunk", "temperature"), [(7, 1.0), (64, 0.7), (1000, 1.3)])
def test_values_and_gradients_match_full_logits(chunk: int, temperature: float) -> None:
    g = torch.Generator().manual_seed(chunk)
    T, H, V = 50, 16, 97
    h0 = torch.randn(T, H, generator=g, dtype=torch.float64).float()
    w0 = torch.randn(V, H, generator=g, dtype=torch.float64).float() * 0.5
    tgt = torch.randint(0, V, (T,), generator=g)
    a_lp = torch.randn(T, generator=g)
    a_en = torch.randn(T, generator=g)

    def run(fn):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, en = fn(h, w)
        ((lp * a_lp).sum() + (en * a_en).sum()).backward()
        return lp.detach(), en.detach(), h.grad, w.grad

    ours = run(lambda h, w: chunked_logprobs(h, w, tgt, temperature=temperature, with_entropy=True, chunk=chunk))
    ref = run(lambda h, w: reference(h, w, tgt, temperature))
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    assert ours[0].max() < 0 and (ours[1] > 0).all()  # log-probs of real distributions, positive entropies


def test_logprob_only_gradient_and_no_entropy() -> None:
    g = torch.Generator().manual_seed(3)
    h = torch.randn(20, 8, generator=g, requires_grad=True)
    w = torch.randn(33, 8, generator=g, requires_grad=True)
    tgt = torch.randint(0, 33, (20,), generator=g)
    lp, en = chunked_logprobs(h, w, tgt, chunk=6)
    assert en is None
    lp.sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    reference(h, w, tgt, 1.0)[0].sum().backward()
    assert torch.allclose(gh, h.grad, atol=1e-5) and torch.allclose(gw, w.grad, atol=1e-5)


def tiny_model(vocab: int = 40) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128,
                      tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg)


def items(vocab: int, n: int = 6):
    from relax_hpc.trainer.batch import TrainItem

    rng = np.random.default_rng(0)
    out = []
    for k in range(n):
        p, r = int(rng.integers(3, 9)), int(rng.integers(4, 14))
        out.append(TrainItem.of(prompt_ids=rng.integers(1, vocab, p), response_ids=rng.integers(1, vocab, r),
                             logprobs=np.full(r, -3.0, dtype=np.float32), loss_mask=np.ones(r),
                             advantage=float(rng.normal()), group_id=str(k // 2)))
    return out


@pytest.fixture
def chunk_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked head also for the tiny test models' small logits."""
    from relax_hpc.trainer import logprobs as L

    monkeypatch.setattr(L, "SMALL_LOGITS", 0)


def test_small_logits_take_the_full_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A micro-batch whose [tokens, vocabulary] logits are small skips the chunks (they only add Python there)."""
    from relax_hpc.trainer import logprobs as L
    from relax_hpc.trainer.batch import build_micro_batch

    model = tiny_model()
    mb = build_micro_batch(items(40))
    elements = mb.targets.numel() * 40
    monkeypatch.setattr(L, "SMALL_LOGITS", elements + 1)
    assert not chunked_supported(model, mb)
    monkeypatch.setattr(L, "SMALL_LOGITS", elements)
    assert chunked_supported(model, mb)


@pytest.mark.parametrize("rows", [False, True])
def test_model_path_matches_full_logits(rows: bool, chunk_small: None) -> None:
    from relax_hpc.trainer.batch import build_micro_batch, response_logits

    model = tiny_model()
    mb = build_micro_batch(items(40), rows=rows)
    assert chunked_supported(model, mb)
    lp, en = response_logprobs(model, mb, temperature=0.8, with_entropy=True, chunk=9)
    (lp.sum() + en.sum()).backward()
    ours = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logits = response_logits(model, mb).float() / 0.8
    lp_all = torch.log_softmax(logits, -1)
    ref_lp = lp_all.gather(-1, mb.targets[:, None])[:, 0]
    ref_en = -(lp_all.exp() * lp_all).sum(-1)
    (ref_lp.sum() + ref_en.sum()).backward()
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(en, ref_en, atol=1e-5)
    for k, p in model.named_parameters():
        assert torch.allclose(ours[k], p.grad, atol=1e-5, rtol=1e-4), k


def test_trainer_step_same_loss_and_update(chunk_small: None) -> None:
    """One TorchTrainer step with the chunked head and one with the full-logits path: same metrics, same weights."""
    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.config.load import validate_dict
    from relax_hpc.trainer import logprobs as L
    from relax_hpc.trainer.torch_trainer import TorchTrainer

    cfg = validate_dict({"data": {"task": {"name": "reverse_digits"}},
                         "trainer": {"lr": 1e-2, "micro_batch_tokens": 64, "device": "cpu"}})
    m1 = tiny_model()
    m2 = copy.deepcopy(m1)
    its = items(40, n=8)
    t1 = TorchTrainer(cfg, m1, device="cpu", dtype=torch.float32, algorithm=get_algorithm("grpo"))
    r1 = t1.train_step(its)
    orig = L.chunked_supported
    L.chunked_supported = lambda *a, **k: False  # the full-logits path, as before this module
    try:
        t2 = TorchTrainer(cfg, m2, device="cpu", dtype=torch.float32, algorithm=get_algorithm("grpo"))
        r2 = t2.train_step(its)
    finally:
        L.chunked_supported = orig
    assert abs(r1["train/loss"] - r2["train/loss"]) < 1e-5
    assert abs(r1["train/grad_norm"] - r2["train/grad_norm"]) < 1e-5 * max(1.0, r2["train/grad_norm"])
    # Adam's first update is ~lr * sign(grad): entries whose gradient is ~0 may differ by rounding, the rest agree
    diff = [float((a - b).detach().abs().max()) for a, b in zip(m1.parameters(), m2.parameters())]
    assert max(diff) < 1e-2 * 1e-2, max(diff)


def test_unsupported_falls_back() -> None:
    from relax_hpc.trainer.batch import build_micro_batch

    model = tiny_model()
    mb = build_micro_batch(items(40))
    assert not chunked_supported(model, mb, world_size=2)
    mb.model_kwargs = {"pixel_values": torch.zeros(1)}
    assert not chunked_supported(model, mb)


def test_entropy_outside_the_loss_costs_no_gradient_change() -> None:
    """Entropies returned but not used in the loss (entropy_coef 0): the gradients are those of the log-probs."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(30, 8, generator=g, requires_grad=True)
    w = torch.randn(41, 8, generator=g, requires_grad=True)
    tgt = torch.randint(0, 41, (30,), generator=g)
    lp, en = chunked_logprobs(h, w, tgt, with_entropy=True, chunk=7)
    assert en is not None and en.requires_grad
    (lp * 2.0).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    (reference(h, w, tgt, 1.0)[0] * 2.0).sum().backward()
    assert torch.allclose(gh, h.grad, atol=1e-5) and torch.allclose(gw, w.grad, atol=1e-5)


@pytest.mark.parametrize(("temperature", "entropy"), [(1.0, False), (0.7, True)])
def test_fusable_chunks_equal_the_eager_ones(temperature: float, entropy: bool) -> None:
    """The formulation the GPU compiles (``fused=True``: a ``where`` over the vocabulary instead of an in-place
    scatter) gives the eager path's values and gradients bit for bit (run eagerly here: compiling is the GPU's)."""
    import relax_hpc.trainer.logprobs as L

    g = torch.Generator().manual_seed(5)
    T, H, V = 40, 16, 53
    h0 = torch.randn(T, H, generator=g)
    w0 = torch.randn(V, H, generator=g) * 0.5
    tgt = torch.randint(0, V, (T,), generator=g)
    a_lp, a_en = torch.randn(T, generator=g), torch.randn(T, generator=g)

    def run(fused: bool):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, en = L.chunked_logprobs(h, w, tgt, temperature=temperature, with_entropy=entropy, chunk=16, fused=fused)
        loss = (lp * a_lp).sum() + ((en * a_en).sum() if en is not None else 0)
        loss.backward()
        return lp.detach(), h.grad, w.grad

    saved = dict(L._COMPILED)
    L._COMPILED.clear()
    L._COMPILED.update({"stats": L._chunk_stats, "grad": L._chunk_grad})  # the fused path's math, not compiled
    try:
        fused = run(True)
    finally:
        L._COMPILED.clear()
        L._COMPILED.update(saved)
    eager = run(False)
    for a, b in zip(fused, eager):
        assert torch.equal(a, b), (a - b).abs().max()


def test_compile_failure_falls_back_to_eager_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    import relax_hpc.trainer.logprobs as L

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    saved = dict(L._COMPILED)
    L._COMPILED.clear()
    L._COMPILED.update({"stats": broken, "grad": broken})
    try:
        h = torch.randn(12, 8, requires_grad=True)
        w = torch.randn(21, 8, requires_grad=True)
        tgt = torch.randint(0, 21, (12,))
        lp, _ = L.chunked_logprobs(h, w, tgt, chunk=5, fused=True)
        lp.sum().backward()
        assert L._COMPILED.get("state") == "failed"
        want = reference(h.detach(), w.detach(), tgt, 1.0)[0]
        assert torch.allclose(lp.detach(), want, atol=1e-5)
        assert sum("torch.compile failed" in r.getMessage() for r in caplog.records) == 1
    finally:
        L._COMPILED.clear()
        L._COMPILED.update(saved)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_head_on_cuda_matches_the_eager_one() -> None:
    """The compiled chunks (the default on a GPU) against the eager ones, bf16 weights at a Qwen-sized vocabulary,
    chunks of uneven length (dynamic shapes), with and without entropy."""
    import relax_hpc.trainer.logprobs as L

    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, V = 3000, 256, 151_936
    h0 = torch.randn(T, H, generator=g, device="cuda", dtype=torch.bfloat16)
    w0 = (torch.randn(V, H, generator=g, device="cuda") * 0.05).bfloat16()
    tgt = torch.randint(0, V, (T,), generator=g, device="cuda")

    def run(fused: bool, ent: bool):
        h, w = h0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        lp, en = L.chunked_logprobs(h, w, tgt, temperature=0.9, with_entropy=ent, chunk=1100, fused=fused)
        ((lp * 0.5).sum() + ((en * 0.3).sum() if en is not None else 0)).backward()
        return lp.detach().float(), h.grad.float(), w.grad.float()

    for ent in (False, True):
        fused, eager = run(True, ent), run(False, ent)
        assert L._COMPILED.get("state") != "failed"
        for a, b in zip(fused, eager):
            scale = b.abs().max().clamp_min(1e-6)
            assert float((a - b).abs().max() / scale) < 2e-2, (a - b).abs().max()
