"""Optional supervised warm-up before RL: cross-entropy on (prompt, answer) pairs, packed without padding.

Real RL starts from a supervised model; the demo does a few supervised steps on its task (or an easier one) so that
RL starts from a policy that sometimes gets rewards. The README reports the reward after warm-up and after RL.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from relax_hpc.trainer.batch import TrainItem, pack, response_logits

log = logging.getLogger(__name__)


def answer_ids(tokenizer: Any, answer: Any) -> list[int]:
    """Token ids of an answer as the assistant would write it, ending with EOS."""
    ids = tokenizer(str(answer), add_special_tokens=False)["input_ids"]
    return [*ids, tokenizer.eos_token_id]


@dataclass(frozen=True)
class WarmupPair:
    """One supervised example already in tokens: the loss is on ``answer_ids``, each token weighted ``weight``."""

    prompt_ids: list[int]
    answer_ids: list[int]
    weight: float = 1.0
    media: dict[str, Any] | None = None


def sft_step(model: Any, optimizer: Any, pairs: list[tuple[list[int], list[int]]], *, max_tokens: int,
             device: str, grad_clip: float = 1.0, media: list[dict[str, Any] | None] | None = None,
             weights: list[float] | None = None) -> float:
    """One supervised update on (prompt ids, answer ids) pairs; ``media``: each pair's media tensors (None for a
    text prompt), given to the model as in RL; ``weights``: each pair's token weight (1). Returns the weighted mean
    token loss."""
    import torch

    from relax_hpc.models.mrope import MRope

    media = media or [None] * len(pairs)
    weights = weights or [1.0] * len(pairs)
    items = [TrainItem.of(prompt_ids=np.asarray(p), response_ids=np.asarray(a), logprobs=np.zeros(len(a)),
                       loss_mask=np.full(len(a), w), tensors=mm or {})
             for (p, a), mm, w in zip(pairs, media, weights, strict=True)]
    mbs = pack(items, max_tokens, device=device,  # sft: small vocab models use rows too
               pack_multimodal=MRope.of(model) is not None)
    n_tok = float(sum(w * len(a) for (_, a), w in zip(pairs, weights, strict=True)))
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for mb in mbs:
        logp = torch.log_softmax(response_logits(model, mb).float(), -1).gather(-1, mb.targets[:, None])[:, 0]
        loss = -(logp * mb.loss_mask).sum() / n_tok
        loss.backward()
        total += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return total


def run_warmup(model: Any, tokenizer: Any, stream: Any, *, steps: int, lr: float, batch_size: int, max_tokens: int,
               device: str, progress: Any = None) -> dict[str, float]:
    """``steps`` supervised updates on pairs drawn from ``stream``: a prompt stream (each prompt with its reference
    answer) or one whose ``next_batch`` gives :class:`WarmupPair` lists (an environment's examples). Returns
    metrics."""
    import torch

    if steps <= 0:
        return {}
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    t0 = time.perf_counter()
    loss = float("nan")
    for k in range(steps):
        batch = [p if isinstance(p, WarmupPair) else
                 WarmupPair(list(p.prompt_ids), answer_ids(tokenizer, p.answer), media=p.multimodal)
                 for p in stream.next_batch(batch_size)]
        loss = sft_step(model, opt, [(p.prompt_ids, p.answer_ids) for p in batch], max_tokens=max_tokens,
                        device=device, media=[p.media for p in batch], weights=[p.weight for p in batch])
        if progress is not None:
            progress(k + 1, steps, loss)
    log.info("warm-up: %d supervised steps in %.1fs, final loss %.3f", steps, time.perf_counter() - t0, loss)
    return {"warmup/loss": loss, "warmup/steps": float(steps), "warmup/seconds": time.perf_counter() - t0}
