"""Optional supervised warm-up before RL: cross-entropy on (prompt, answer) pairs, packed without padding.

Real RL starts from a supervised model; the demo does a few supervised steps on its task (or an easier one) so that
RL starts from a policy that sometimes gets rewards. The README reports the reward after warm-up and after RL.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from relax_hpc.trainer.batch import TrainItem, pack, response_logits

log = logging.getLogger(__name__)


def answer_ids(tokenizer: Any, answer: Any) -> list[int]:
    """Token ids of an answer as the assistant would write it, ending with EOS."""
    ids = tokenizer(str(answer), add_special_tokens=False)["input_ids"]
    return [*ids, tokenizer.eos_token_id]


def sft_step(model: Any, optimizer: Any, pairs: list[tuple[list[int], list[int]]], *, max_tokens: int,
             device: str, grad_clip: float = 1.0) -> float:
    """One supervised update on (prompt ids, answer ids) pairs. Returns the mean token loss."""
    import torch

    items = [TrainItem(prompt_ids=np.asarray(p), response_ids=np.asarray(a), rollout_logprobs=np.zeros(len(a)),
                       loss_mask=np.ones(len(a))) for p, a in pairs]
    mbs = pack(items, max_tokens, device=device)  # sft: small vocab models use rows too
    n_tok = float(sum(len(a) for _, a in pairs))
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
    """``steps`` supervised updates on pairs drawn from ``stream`` (a prompt stream). Returns metrics."""
    import torch

    if steps <= 0:
        return {}
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    t0 = time.perf_counter()
    loss = float("nan")
    for k in range(steps):
        batch = stream.next_batch(batch_size)
        pairs = [(list(p.prompt_ids), answer_ids(tokenizer, p.answer)) for p in batch]
        loss = sft_step(model, opt, pairs, max_tokens=max_tokens, device=device)
        if progress is not None:
            progress(k + 1, steps, loss)
    log.info("warm-up: %d supervised steps in %.1fs, final loss %.3f", steps, time.perf_counter() - t0, loss)
    return {"warmup/loss": loss, "warmup/steps": float(steps), "warmup/seconds": time.perf_counter() - t0}
