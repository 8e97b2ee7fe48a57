"""Per-token log-probs (and entropies) of the response tokens without materialising full-vocabulary logits.

The trainer needs, for each of the T response tokens of a micro-batch, ``log softmax(h W^T / temperature)[target]``
(and, where the loss has an entropy term, the entropy of that distribution). The plain way builds the
``[T, V]`` float32 logits (V = 151,936 for Qwen: 0.6 GB per 1,000 tokens, several copies for softmax and backward),
which is what ran a Qwen3-4B-shaped model out of memory at ``micro_batch_tokens: 16384``.

:func:`chunked_logprobs` runs the LM head over ``chunk`` tokens at a time inside one autograd function: the forward
keeps only the hidden states, the targets and the log-sum-exp per token; the backward recomputes each chunk's logits
and turns the incoming gradients into the hidden-state and head-weight gradients chunk by chunk. Peak extra memory is
a few ``[chunk, V]`` float32 tensors whatever T is. Values and gradients are those of the plain computation
(the logits are computed in the model's dtype and upcast to float32, as the plain path does; float32 on the CPU
agrees to ~1e-6, see ``tests/unit/test_logprobs.py``).

:func:`response_logprobs` is the trainer's entry point: the decoder's hidden states at the positions that predict
the response tokens (``model.model``), then the chunked head, for plain causal LMs on one rank; anything else
(multimodal inputs, FSDP-sharded weights, a head with a bias or logit soft-capping) keeps the full-logits path.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_ELEMENTS = 1 << 27
"""Logit elements per chunk (``chunk * V``): 512 MB of float32 per chunk tensor."""


def default_chunk(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab`` entries (at least 64)."""
    return max(64, CHUNK_ELEMENTS // max(1, vocab))


def _chunk_stats(z: torch.Tensor, tgt: torch.Tensor, inv_t: float,
                 with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log-prob of ``tgt``, log-sum-exp, entropy or None) of one chunk's logits ``z`` (model dtype; float32
    from here on)."""
    z = z.float()
    if inv_t != 1.0:
        z = z * inv_t
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, tgt[:, None])[:, 0] - lse
    ent = None
    if with_entropy:
        p = torch.softmax(z, dim=-1)
        ent = lse - (p * z).sum(-1)
    return logp, lse, ent


def _chunk_grad(z: torch.Tensor, lse: torch.Tensor, tgt: torch.Tensor, g_logp: torch.Tensor | None,
                ent: torch.Tensor | None, g_ent: torch.Tensor | None, inv_t: float, dtype: torch.dtype,
                fusable: bool) -> torch.Tensor:
    """d loss / d z of one chunk, in ``dtype``: ``g_logp * (onehot(t) - p)`` plus the entropy term
    ``-g_ent * p * (log p + H)``, times ``1 / temperature``.

    ``fusable`` writes the one-hot term as a ``where`` over the vocabulary instead of an in-place scatter, so that
    ``torch.compile`` makes the whole chunk one elementwise kernel; both give the same float32 values
    (``g + (-p g)`` and ``g - p g`` round alike), only the eager ``where`` allocates more."""
    zf = z.float()
    if inv_t != 1.0:
        zf = zf * inv_t
    logp_all = zf - lse[:, None]
    p = logp_all.exp()
    gz: torch.Tensor | None = None
    if g_logp is not None:
        g = g_logp[:, None]
        if fusable:
            hit = torch.arange(z.shape[-1], device=z.device)[None, :] == tgt[:, None]
            gz = torch.where(hit, g - p * g, -p * g)
        else:
            gz = -p * g
            gz.scatter_add_(-1, tgt[:, None], g)
    if g_ent is not None and ent is not None:
        term = p * (logp_all + ent[:, None]) * g_ent[:, None]
        gz = -term if gz is None else gz - term
    assert gz is not None
    if inv_t != 1.0:
        gz = gz * inv_t
    return gz.to(dtype)


_COMPILED: dict[str, Any] = {}
"""``torch.compile``d chunk functions (built on first use on a GPU; ``"failed"`` once compiling failed)."""


def _kernels(fused: bool) -> tuple[Any, Any]:
    """(stats, grad) chunk functions: compiled (dynamic shapes: chunks and micro-batches vary) when ``fused`` and
    compiling works here, else the eager ones."""
    if not fused or _COMPILED.get("state") == "failed":
        return _chunk_stats, _chunk_grad
    if "stats" not in _COMPILED:
        _COMPILED["stats"] = torch.compile(_chunk_stats, dynamic=True)
        _COMPILED["grad"] = torch.compile(_chunk_grad, dynamic=True)
    return _COMPILED["stats"], _COMPILED["grad"]


def _call(fused: bool, which: int, *args: Any) -> Any:
    """Call kernel ``which`` (0 stats, 1 grad); a compile failure falls back to eager for good, with one warning."""
    fn = _kernels(fused)[which]
    if fn is _chunk_stats or fn is _chunk_grad:
        return fn(*args)
    try:
        return fn(*args)
    except Exception as e:  # any compiler failure: the eager path computes the same values
        import logging

        logging.getLogger(__name__).warning("fused LM head: torch.compile failed (%s: %s); using the eager chunks",
                                            type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
        _COMPILED["state"] = "failed"
        return (_chunk_stats, _chunk_grad)[which](*args)


class _ChunkedLogprobs(torch.autograd.Function):
    """Autograd function: (hidden [T, H], weight [V, H], targets [T]) -> (logp [T], entropy [T]) in float32."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, inv_t: float,
                chunk: int, with_entropy: bool, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            lp, ls, en = _call(fused, 0, hidden[s:e] @ weight.t(), targets[s:e], inv_t, with_entropy)
            logp[s:e] = lp
            lse[s:e] = ls
            if en is not None:
                ent[s:e] = en
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.set_materialize_grads(False)  # an entropy outside the loss (entropy_coef 0) costs no backward work
        ctx.inv_t, ctx.chunk, ctx.with_entropy, ctx.fused = inv_t, chunk, with_entropy, fused
        return logp, ent

    @staticmethod
    def backward(ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None) -> tuple[Any, ...]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        inv_t, chunk, fused = ctx.inv_t, ctx.chunk, ctx.fused
        use_ent = ctx.with_entropy and g_ent is not None
        if g_logp is None and not use_ent:
            return None, None, None, None, None, None, None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        n = hidden.shape[0]
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            h = hidden[s:e]
            gz = _call(fused, 1, h @ weight.t(), lse[s:e], targets[s:e], None if g_logp is None else g_logp[s:e],
                       ent[s:e] if use_ent else None, g_ent[s:e] if use_ent else None, inv_t, weight.dtype, fused)
            if grad_h is not None:
                grad_h[s:e] = gz @ weight
            if grad_w is not None:
                if weight.dtype == torch.float32:
                    grad_w.addmm_(gz.t(), h)
                else:  # one bf16 product per chunk (as the plain path's), summed in float32
                    grad_w.add_(gz.t() @ h)
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                     with_entropy: bool = False, chunk: int | None = None,
                     fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[T]`` (float32) of ``targets`` under ``softmax(hidden @ weight.T / temperature)`` and, with
    ``with_entropy``, the entropies ``[T]``; never more than ``chunk`` rows of logits at once. ``fused``: compile
    each chunk's elementwise work into fused kernels (``torch.compile``); None = on CUDA tensors only."""
    assert hidden.dim() == 2 and targets.dim() == 1 and hidden.shape[0] == targets.shape[0]
    chunk = chunk or default_chunk(weight.shape[0])
    fused = hidden.is_cuda if fused is None else fused
    logp, ent = _ChunkedLogprobs.apply(hidden, weight, targets, 1.0 / temperature, chunk, with_entropy, fused)
    return logp, (ent if with_entropy else None)


SMALL_LOGITS = 1 << 22
"""Below this many ``[tokens, vocabulary]`` elements (16 MB in float32) a micro-batch's full logits are cheaper than
the chunked head's custom autograd function (tiny models: the chunks only add Python per micro-batch)."""


def chunked_supported(model: Any, mb: Any, *, world_size: int = 1) -> bool:
    """True when the chunked head applies and pays: a plain ``*ForCausalLM`` with ``.model`` and a bias-free
    ``lm_head``, one rank (FSDP-sharded root weights are only gathered by the full forward), no multimodal inputs, no
    logit soft-capping or scaling, and full logits of at least :data:`SMALL_LOGITS` elements."""
    if mb.model_kwargs or not model_supported(model, world_size=world_size):
        return False
    return mb.targets.numel() * model.lm_head.weight.shape[0] >= SMALL_LOGITS


def model_supported(model: Any, *, world_size: int = 1) -> bool:
    """:func:`chunked_supported` without a micro-batch (text-only micro-batches of this model)."""
    name = type(model).__name__
    if world_size > 1 or not name.endswith("ForCausalLM") or name.startswith("Peft"):  # PEFT: pass the module it wraps
        return False
    head = getattr(model, "lm_head", None)
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or not hasattr(model, "model"):
        return False
    cfg = getattr(model, "config", None)
    return all(getattr(cfg, k, None) in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale"))


def response_hidden(model: Any, mb: Any) -> torch.Tensor:
    """The final hidden states ``[T, H]`` at the positions whose logits predict each response token."""
    out = model.model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)
    return out.last_hidden_state.flatten(0, 1)[mb.logit_index]


def response_logprobs(model: Any, mb: Any, *, temperature: float, with_entropy: bool, chunk: int | None = None,
                      fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[T]`` (and entropies) of ``mb``'s response tokens through the chunked head."""
    hidden = response_hidden(model, mb)
    return chunked_logprobs(hidden, model.lm_head.weight, mb.targets, temperature=temperature,
                            with_entropy=with_entropy, chunk=chunk, fused=fused)
