"""A tiny Qwen3 model from config whose outputs depend on the prompt and the position (engine tests)."""

from __future__ import annotations

import torch

VOCAB = 24


def tiny_model() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    m = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # weights large enough that outputs depend on the prompt and the position
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    return m


IDS = torch.tensor([[1, 7, 9, 4, 16, 5, 13]])
"""A prompt of the demo's digits tokenizer."""


def tiny_demo_model() -> torch.nn.Module:
    """The demo's tiny model (the default ``model.tiny`` shape, seed 3) in eval mode."""
    from relax_hpc.config.schema import TinyModelConfig
    from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model

    tok = build_digits_tokenizer()
    return build_tiny_model(TinyModelConfig(), len(tok), seed=3, pad_token_id=tok.pad_token_id,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id).eval()
