"""A tiny tied-embedding Qwen3 and random train items, for the log-prob and compiled-layer tests."""

from __future__ import annotations

import numpy as np
import torch


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
