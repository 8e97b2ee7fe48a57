"""``trainer.compile_layers`` (models/compiled.py): the compiled decoder layers give the eager layers' log-probs and
gradients, are in force only inside ``active()``, and a compile failure falls back to the eager layers. Runs on the
CPU (inductor's C++ backend); the trainer itself switches them on only on a GPU."""

from __future__ import annotations

import logging

import pytest
import torch

from relax_hpc.models.compiled import CompiledLayers, decoder_layers
from relax_hpc.trainer.batch import pack
from relax_hpc.trainer.logprobs import response_logprobs
from tests.helpers.trainitems import items, tiny_model


def _logprobs_and_grads(model: torch.nn.Module, ctx) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    outs = []
    for mb in pack(items(40), 64):
        with ctx():
            logp, _ = response_logprobs(model, mb, temperature=1.0, with_entropy=False, fused=False)
        (logp * mb.advantages).sum().backward()
        outs.append(logp.detach())
    return torch.cat(outs), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_the_decoder_layers_are_found():
    model = tiny_model()
    assert decoder_layers(model) == list(model.model.layers)
    assert decoder_layers(torch.nn.Linear(2, 2)) == []


@pytest.mark.slow
def test_compiled_layers_match_the_eager_ones_and_only_inside_active():
    import contextlib

    torch._dynamo.reset()
    model = tiny_model()
    ref_lp, ref_g = _logprobs_and_grads(model, contextlib.nullcontext)
    compiled = CompiledLayers(model)
    lp, g = _logprobs_and_grads(model, compiled.active)
    assert not compiled.failed
    assert torch.allclose(lp, ref_lp, atol=1e-5), (lp - ref_lp).abs().max()
    assert len(g) == len(ref_g) and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g, ref_g))
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)  # eager again outside
    with compiled.active():
        assert all("forward" in layer.__dict__ for layer in model.model.layers)


def test_a_compile_failure_falls_back_to_the_eager_layers(monkeypatch, caplog):
    import contextlib

    model = tiny_model()
    ref_lp, ref_g = _logprobs_and_grads(model, contextlib.nullcontext)

    def broken(fn, **kwargs):
        def call(*a, **k):
            raise RuntimeError("inductor: no C++ compiler")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    compiled = CompiledLayers(model)
    with caplog.at_level(logging.WARNING):
        lp, g = _logprobs_and_grads(model, compiled.active)
    assert compiled.failed
    assert sum("compile_layers" in r.message for r in caplog.records) == 1
    assert torch.equal(lp, ref_lp) and all(torch.equal(a, b) for a, b in zip(g, ref_g))


def test_an_out_of_memory_error_is_not_swallowed(monkeypatch):
    model = tiny_model()

    def oom(fn, **kwargs):
        def call(*a, **k):
            raise torch.OutOfMemoryError("CUDA out of memory")
        return call

    monkeypatch.setattr(torch, "compile", oom)
    compiled = CompiledLayers(model)
    with pytest.raises(torch.OutOfMemoryError):
        _logprobs_and_grads(model, compiled.active)
    assert not compiled.failed
