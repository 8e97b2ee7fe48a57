"""models/fused.py: the fused RMSNorm computes what transformers' RMSNorm computes (values and gradients, whole
model in float32), and only plain RMSNorms are swapped."""

from __future__ import annotations

import copy

import torch

from relax_hpc.models.fused import fuse_rms_norms, is_plain_rms_norm


def test_fused_rms_norm_same_model_outputs_and_gradients() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64)
    ref = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for m in ref.modules():
            if is_plain_rms_norm(m):
                m.weight.normal_(1.0, 0.3)  # not all ones: the weight's place in the formula matters
    fused = copy.deepcopy(ref)
    assert fuse_rms_norms(fused) == 2 * 4 + 1  # per layer: input, post-attention, q and k norms; the final norm
    ids = torch.randint(0, 50, (3, 11))
    out = [m(input_ids=ids, labels=ids) for m in (ref, fused)]
    assert torch.allclose(out[0].logits, out[1].logits, atol=1e-5)
    for o in out:
        o.loss.backward()
    for (k, a), b in zip(ref.named_parameters(), fused.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), k


def test_only_plain_rms_norms() -> None:
    assert not is_plain_rms_norm(torch.nn.LayerNorm(8))
    assert not is_plain_rms_norm(torch.nn.Linear(2, 2))
