"""The trainer's ready block-diagonal masks of packed rows (``models/masks.py``, ``trainer/batch.response_logits``):
the same logits and gradients as the model's own mask building from the position ids, on real packed micro-batches
(several sequences per row, padding tails), and no mask where no row holds two sequences."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relax_hpc.models.masks import packed_mask
from relax_hpc.trainer.batch import TrainItem, pack, response_logits

VOCAB = 16


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128,
                      attn_implementation="sdpa")
    m = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
    return m


def items(k: int, seed: int = 0) -> list[TrainItem]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(k):
        r = rng.integers(1, VOCAB, int(rng.integers(2, 9)))
        out.append(TrainItem.of(prompt_ids=rng.integers(1, VOCAB, int(rng.integers(3, 12))), response_ids=r,
                             logprobs=np.zeros(len(r), np.float32), loss_mask=np.ones(len(r), np.uint8),
                             reward=0.0, version=0, group_id="g"))
    return out


def grads_and_logits(model: torch.nn.Module, mb: object) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = response_logits(model, mb)
    (logits.float().square().mean()).backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("rows", [True, False], ids=["rows", "one-row"])
def test_packed_rows_with_ready_masks_equal_the_models_own(model: torch.nn.Module, rows: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import relax_hpc.models.masks as masks

    mbs = pack(items(40), 4096, rows=rows)
    assert len(mbs) == 1
    mb = mbs[0]
    mask = packed_mask(mb.position_ids)
    assert mask is not None and mask.shape == (mb.input_ids.shape[0], 1, mb.input_ids.shape[1], mb.input_ids.shape[1])
    seen = []
    real = masks.packed_mask
    monkeypatch.setattr(masks, "packed_mask", lambda pos: seen.append(1) or real(pos))
    ours = grads_and_logits(model, mb)
    assert seen, "the trainer must have used its own mask for an SDPA model on the CPU"
    monkeypatch.setattr(masks, "own_masks", lambda m: False)
    theirs = grads_and_logits(model, mb)
    assert len(seen) == 1, "with own_masks off the model builds its mask"
    assert torch.equal(ours[0], theirs[0])
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_no_mask_where_no_row_holds_two_sequences() -> None:
    pos = torch.arange(10).repeat(3, 1)
    assert packed_mask(pos) is None
    pos[1, 6:] = torch.arange(4)  # a second sequence in row 1
    mask = packed_mask(pos)
    assert mask is not None
    assert bool(mask[1, 0, 7, 6]) and not bool(mask[1, 0, 7, 5]), "a query sees its own sequence only"
    assert bool(mask[0, 0, 9, 0]) and not bool(mask[0, 0, 0, 1]), "causal within a sequence"
