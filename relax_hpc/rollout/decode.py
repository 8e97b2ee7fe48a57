"""A plain sampling loop over a HF causal LM with a KV cache: the ``hf`` engine's fast path for text prompts.

``transformers.generate`` spends most of its time outside the model on small models (logits processors, stopping
criteria, output bookkeeping, the full logits of every step kept for the log-probs); this loop does only what
sampling needs and computes each token's log-prob as it goes. It samples exactly as ``generate`` does for the
same settings (temperature, then top-k, then top-p, then ``torch.multinomial`` on the softmax; greedy is the
argmax), finished rows are filled with the pad token, and it stops when every row has produced EOS.

The recorded log-prob of a token is under ``logits / temperature`` without the top-k/top-p cut (the sampling policy
the trainer's importance weights compare against), as the ``generate`` path records it.

Used for models that take ``input_ids`` alone (``*ForCausalLM`` without a vision or audio tower) and without stop
strings or sharded (FSDP) weights; everything else goes through ``generate`` (see :class:`HFEngine`).
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch

from relax_hpc.models.masks import own_masks, prompt_mask


class DecodeControl(Protocol):
    """How an engine steers a running batch: called every ``every`` tokens, between a token and the next forward."""

    every: int

    def check(self, generated: int) -> list[int]:
        """``generated`` tokens exist in every row. Returns the rows to stop now (aborted requests), after running
        the engine's pending commands and, while the engine is paused without abort, holding the batch (weights
        may change meanwhile: the next forward uses them)."""
        ...


def loop_supported(model: Any) -> bool:
    """True for a plain causal LM whose forward takes a KV cache."""
    cfg = getattr(model, "config", None)
    if not type(model).__name__.endswith("ForCausalLM") or cfg is None:
        return False
    if any(getattr(cfg, k, None) is not None for k in ("vision_config", "audio_config", "thinker_config")):
        return False
    return cache_kwarg(model) is not None


def cache_kwarg(model: Any) -> str | None:
    """The forward argument that takes the KV cache: ``cache`` (transformers 5) or ``past_key_values``."""
    params = inspect.signature(type(model).forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return None


def last_logits_kwarg(model: Any) -> dict[str, int]:
    """Ask the forward for the last position's logits only, where it takes that argument."""
    params = inspect.signature(type(model).forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: 1}
    return {}


def new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def warp(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling scores: ``generate``'s temperature, top-k and top-p warpers, in its order and with its ops."""
    scores = logits / temperature if temperature != 1.0 else logits
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -float("inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, sorted_idx, remove), -float("inf"))
    return scores


@torch.no_grad()
def sample(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, n: int, max_new_tokens: int,
           temperature: float, top_k: int, top_p: float, eos_id: int, pad_id: int,
           stop_ids: tuple[int, ...] = (), generator: torch.Generator | None = None,
           control: DecodeControl | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` responses per left-padded prompt row. Returns (tokens ``[B*n, R]``, log-probs ``[B*n, R]`` float32),
    rows ordered prompt by prompt (as ``generate`` with ``num_return_sequences=n``); ``R <= max_new_tokens``.

    A row ends on ``eos_id`` or any of ``stop_ids``; ``generator`` drives the sampling (default: torch's global one);
    ``control`` may stop rows or hold the batch every ``control.every`` tokens (rows it stops are padded after the
    tokens they had)."""
    greedy = temperature == 0
    t_lp = 1.0 if greedy else temperature
    prompts, width = input_ids.shape
    rows = prompts * n
    dev = input_ids.device
    cache = new_cache(model)
    cache_arg = {cache_kwarg(model) or "past_key_values": cache}
    # the prompt is read once (its KV cache and last logits are then repeated for the n samples): a prompt as long
    # as the responses costs as much to read as all n responses to generate
    positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    ready = own_masks(model)  # 4-D masks made here, not by the model at every step (models/masks.py)
    out = model(input_ids=input_ids, attention_mask=prompt_mask(attention_mask) if ready else attention_mask,
                position_ids=positions, use_cache=True, **last_logits_kwarg(model), **cache_arg)
    logits = out.logits[:, -1, :].float()
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits = logits.repeat_interleave(n, dim=0)
    attn = torch.ones((rows, width + max_new_tokens), dtype=attention_mask.dtype, device=dev)
    attn[:, :width] = attention_mask.repeat_interleave(n, dim=0)
    step_mask = attn.bool()[:, None, None, :] if ready else attn  # a decode step's query: [rows, 1, 1, keys]
    pos = positions[:, -1:].repeat_interleave(n, dim=0)
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=dev)
    logprobs = torch.zeros((rows, max_new_tokens), dtype=torch.float32, device=dev)
    done = torch.zeros(rows, dtype=torch.bool, device=dev)
    pad = torch.full((rows,), pad_id, dtype=torch.long, device=dev)
    stops = torch.tensor(sorted({eos_id, *stop_ids}), dtype=torch.long, device=dev)
    steps = 0
    for t in range(max_new_tokens):
        if t:
            logits = out.logits[:, -1, :].float()
        if greedy:
            tok = logits.argmax(dim=-1)
        else:
            probs = warp(logits, temperature=temperature, top_k=top_k, top_p=top_p).softmax(dim=-1)
            tok = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
        tok = torch.where(done, pad, tok)
        lp = torch.log_softmax(logits / t_lp if t_lp != 1.0 else logits, dim=-1).gather(-1, tok[:, None])[:, 0]
        tokens[:, t] = tok
        logprobs[:, t] = lp
        done |= torch.isin(tok, stops) if len(stops) > 1 else tok == eos_id
        steps = t + 1
        if control is not None and steps % control.every == 0 and t < max_new_tokens - 1:
            stopped = control.check(steps)
            if stopped:
                done[torch.tensor(stopped, dtype=torch.long, device=dev)] = True
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        pos = pos + 1
        out = model(input_ids=tok[:, None], attention_mask=step_mask[..., :width + t + 1], position_ids=pos,
                    use_cache=True, **cache_arg)
    return tokens[:, :steps], logprobs[:, :steps]
