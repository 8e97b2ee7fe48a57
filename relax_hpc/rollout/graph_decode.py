"""A decode loop over a static KV cache whose step is captured as a CUDA graph: the ``hf`` engine's path on a GPU.

The plain loop (:mod:`relax_hpc.rollout.decode`) launches every kernel of every layer from Python for every token,
so on a GPU it is bound by launch overhead, not by the GPU (a Qwen3-0.6B and a Qwen3-4B shape decoded at almost the
same speed). Here:

- **static state** sized for the batch (``rows`` = prompts x n, ``L`` = prompt width + new tokens, rounded up):
  per-layer key/value caches ``[rows, kv_heads, L, head_dim]``, the valid-key mask, positions, last tokens, done
  flags and the token / log-prob history, all allocated once and kept between calls of the same size;
- **prefill once per prompt**: the model's own forward over the left-padded prompts; its KV cache and last logits
  are repeated for the n samples (the prompt is read once, not n times);
- **the decode step** (embed the last token, every decoder layer with its attention written against the static
  cache, the head, sampling, recording, advancing the counters) touches only static tensors, so on CUDA the steps
  between two stop checks are captured once per (batch-size bucket, attention span, steps) as one CUDA graph and
  replayed (one launch per ``check_every`` tokens); the attention span is the
  used part of the cache rounded up to ``SPAN`` columns, so early steps do not read the whole cache;
- **sampling on the GPU inside the graph**: temperature, top-k, top-p (``decode.warp``: the same ops as
  ``generate``), then one draw; the token's log-prob is recorded under ``logits / temperature`` as in the plain loop;
- **host synchronisation only for stop checks** every ``check_every`` tokens; when the unfinished rows fit a smaller
  bucket (powers of two) they are moved to the front (with their caches) and the smaller graph runs from then on.

On the CPU there are no graphs and, by default, no compaction: every step runs eagerly over all rows and draws with
``torch.multinomial`` exactly as the plain loop, so for the same seed it samples the same tokens (the model's
decoder layers are computed with the same modules; tests/unit/test_graph_decode.py). On CUDA the draw is
``argmax(p / Exp(1))`` (what ``torch.multinomial`` does for one sample, written out so it is captured with the
graph's RNG offsets): the same distribution.

Applies to Llama-style decoders (Qwen3, Qwen2, Llama: ``self_attn.{q,k,v,o}_proj``, optional ``q_norm``/``k_norm``,
default RoPE, no sliding window) that :func:`relax_hpc.rollout.decode.loop_supported` accepts; :func:`supported`
says which.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from relax_hpc.rollout.decode import cache_kwarg, last_logits_kwarg, loop_supported, new_cache, warp

SPAN = 64
"""Granularity (cache columns) of the attention span a captured step reads."""
MODEL_TYPES = ("qwen3", "qwen2", "llama")


def supported(model: Any) -> bool:
    """True for a Llama-style causal LM this loop computes layer by layer (see the module docstring)."""
    if not loop_supported(model):
        return False
    cfg = model.config
    if getattr(cfg, "model_type", None) not in MODEL_TYPES or getattr(cfg, "use_sliding_window", False):
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False
    inner = getattr(model, "model", None)
    rope = getattr(getattr(inner, "rotary_emb", None), "rope_type", None)
    if rope != "default" or not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        return False
    attn = inner.layers[0].self_attn
    return all(hasattr(attn, k) for k in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))


@dataclass(frozen=True)
class _Sampling:
    temperature: float
    top_k: int
    top_p: float
    eos_id: int
    pad_id: int


def buckets(rows: int) -> list[int]:
    """Batch sizes the loop shrinks through: ``rows`` and the powers of two below it (descending)."""
    out = [rows]
    b = 1
    while b < rows:
        b *= 2
    b //= 2
    while b >= 1:
        if b < rows:
            out.append(b)
        b //= 2
    return out


class GraphDecoder:
    """The static decode state of one model and its captured steps (kept between calls of the same size)."""

    def __init__(self, model: Any, *, use_graphs: bool | None = None, compact: bool | None = None,
                 check_every: int | None = None, compiled: bool = False):
        p = next(model.parameters())
        self.model = model
        self.device = p.device
        self.dtype = p.dtype
        cuda = self.device.type == "cuda"
        self.use_graphs = cuda if use_graphs is None else use_graphs
        self.compact = cuda if compact is None else compact
        self.check_every = check_every or (8 if cuda else 1)
        inner = model.model
        self.inner = inner
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.scaling = float(attn.scaling)
        cfg = model.config
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.q_heads = int(cfg.num_attention_heads)
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self._pre, self._post = layer_parts(compiled)
        self.rows = 0
        self.length = 0
        self.graphs: dict[tuple[int, int, int, _Sampling], Any] = {}
        self._pool: Any = None
        self._stream: Any = None
        self.captures = 0
        """CUDA graphs captured so far (a figure for benchmarks and tests)."""

    # ------------------------------------------------------------------ state
    def _alloc(self, rows: int, length: int) -> None:
        """(Re)allocate the static state for ``rows`` x ``length`` (dropping captured graphs) unless it fits."""
        if rows == self.rows and length <= self.length:
            return
        self.release()
        dev, dt = self.device, self.dtype
        shape = (rows, self.kv_heads, length, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dt, device=dev) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=dt, device=dev) for _ in self.layers]
        self.valid = torch.zeros((rows, length), dtype=torch.bool, device=dev)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=dev)
        self.last = torch.zeros(rows, dtype=torch.long, device=dev)
        self.done = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.slot_row = torch.arange(rows, dtype=torch.long, device=dev)
        self.hist_tok = torch.zeros((rows, length), dtype=torch.long, device=dev)  # new tokens < length
        self.hist_lp = torch.zeros((rows, length), dtype=torch.float32, device=dev)
        self.col = torch.zeros(1, dtype=torch.long, device=dev)
        self.t = torch.zeros(1, dtype=torch.long, device=dev)
        self.rows, self.length = rows, length
        if self.use_graphs:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device=dev)

    def release(self) -> None:
        """Free the static state and the captured graphs (they are rebuilt at the next call)."""
        self.graphs.clear()
        for name in ("k", "v", "valid", "pos", "last", "done", "slot_row", "hist_tok", "hist_lp", "col", "t"):
            self.__dict__.pop(name, None)
        self.rows = self.length = 0
        self._pool = None

    # ------------------------------------------------------------------ the step
    def _draw(self, logits: torch.Tensor, s: _Sampling) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, its log-prob under logits / temperature) per row, as the plain loop samples."""
        greedy = s.temperature == 0
        if greedy:
            tok = logits.argmax(dim=-1)
        else:
            probs = warp(logits, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p).softmax(dim=-1)
            if probs.is_cuda:  # torch.multinomial's one-sample method, written out so a graph captures it
                tok = probs.div(torch.empty_like(probs).exponential_()).argmax(dim=-1)
            else:
                tok = torch.multinomial(probs, num_samples=1).squeeze(1)
        t_lp = 1.0 if greedy else s.temperature
        lp = torch.log_softmax(logits / t_lp if t_lp != 1.0 else logits, dim=-1).gather(-1, tok[:, None])[:, 0]
        return tok, lp

    def _record(self, b: int, tok: torch.Tensor, lp: torch.Tensor, s: _Sampling) -> None:
        tok = torch.where(self.done[:b], torch.full_like(tok, s.pad_id), tok)
        self.hist_tok[:b].index_copy_(1, self.t, tok[:, None])
        self.hist_lp[:b].index_copy_(1, self.t, lp[:, None])
        self.done[:b] |= tok == s.eos_id
        self.last[:b] = tok

    def _layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: int, span: int,
               mask: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        q, k, v = self._pre(layer, x, cos, sin, self.rope, self.head_dim)
        self.k[i][:b].index_copy_(2, self.col, k)
        self.v[i][:b].index_copy_(2, self.col, v)
        # grouped-query attention of one new token: the query heads of a kv head are that head's "query length";
        # ``mask`` is additive (0 or -inf), built once per step (plain batched matmuls were ~10% faster but round
        # the scores to bf16 before the softmax: tools/gpu/attn_micro.py)
        qg = q.reshape(b, self.kv_heads, self.q_heads // self.kv_heads, self.head_dim)
        o = torch.nn.functional.scaled_dot_product_attention(
            qg, self.k[i][:b, :, :span], self.v[i][:b, :, :span], attn_mask=mask, scale=self.scaling)
        return self._post(layer, x, o.reshape(b, 1, self.q_heads * self.head_dim))

    def _step(self, b: int, span: int, s: _Sampling) -> None:
        """One decode step over the first ``b`` rows, reading ``span`` cache columns; touches only static state."""
        x = self.inner.embed_tokens(self.last[:b, None])
        cos, sin = self.inner.rotary_emb(x, self.pos[:b])
        self.valid[:b].index_fill_(1, self.col, True)
        mask = torch.zeros((b, 1, 1, span), dtype=x.dtype, device=x.device).masked_fill_(
            ~self.valid[:b, None, None, :span], float("-inf"))  # once per step, shared by the layers
        for i in range(len(self.layers)):
            x = self._layer(i, x, cos, sin, b, span, mask)
        logits = self.model.lm_head(self.inner.norm(x))[:, 0].float()
        tok, lp = self._draw(logits, s)
        self._record(b, tok, lp, s)
        self.pos[:b] += 1
        self.col += 1
        self.t += 1

    def _steps(self, b: int, span: int, n: int, s: _Sampling) -> None:
        for _ in range(n):
            self._step(b, span, s)

    def _run(self, b: int, span: int, n: int, s: _Sampling) -> None:
        """``n`` steps: eagerly, or replayed from their CUDA graph (captured right after running them once for
        real). One graph holds the steps between two stop checks, so the host launches once per ``n`` tokens (a
        thread writing snapshot files meanwhile cannot stall every token on the interpreter lock)."""
        if not self.use_graphs:
            self._steps(b, span, n, s)
            return
        key = (b, span, n, s)
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
            return
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the real steps; warm kernels and workspaces on the capture stream
            self._steps(b, span, n, s)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        # thread_local: the snapshot thread may wait on a CUDA event meanwhile (weights/transport/memory.py)
        with torch.cuda.graph(g, pool=self._pool, stream=stream, capture_error_mode="thread_local"):  # recorded
            self._steps(b, span, n, s)
        self.graphs[key] = g
        self.captures += 1

    # ------------------------------------------------------------------ prefill and the loop
    def _prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int, s: _Sampling) -> None:
        """The prompts through the model once; KV cache, valid mask and positions repeated for the n samples; the
        first token drawn from the last logits."""
        model = self.model
        width = input_ids.shape[1]
        cache = new_cache(model)
        positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                    **last_logits_kwarg(model), **{cache_kwarg(model) or "past_key_values": cache})
        logits = out.logits[:, -1, :].float()
        rows = input_ids.shape[0] * n
        for i, (k, v) in enumerate(cache_layers(cache)):
            self.k[i][:rows, :, :width] = k.repeat_interleave(n, dim=0)
            self.v[i][:rows, :, :width] = v.repeat_interleave(n, dim=0)
        self.valid[:rows] = False
        self.valid[:rows, :width] = attention_mask.bool().repeat_interleave(n, dim=0)
        self.pos[:rows] = positions[:, -1:].repeat_interleave(n, dim=0) + 1
        self.done[:rows] = False
        self.slot_row[:rows] = torch.arange(rows, device=self.device)
        self.hist_tok[:rows] = s.pad_id
        self.hist_lp[:rows] = 0.0
        self.t.zero_()
        self.col.fill_(width)
        if n > 1:
            logits = logits.repeat_interleave(n, dim=0)
        tok, lp = self._draw(logits, s)
        self._record(rows, tok, lp, s)
        self.t += 1

    def _shrink(self, b: int, active: int) -> int:
        """Move the unfinished rows (with their caches) to the front; returns the new bucket size."""
        nb = next(x for x in reversed(buckets(self.rows)) if x >= active)
        if nb >= b:
            return b
        perm = torch.argsort(self.done[:b].to(torch.int8), stable=True)  # unfinished first, order kept
        keep = perm[:nb]
        for cache in (*self.k, *self.v):
            cache[:nb] = cache[keep]
        for st in (self.valid, self.pos, self.last, self.done, self.slot_row, self.hist_tok, self.hist_lp):
            st[:b] = st[perm]
        return nb

    @torch.no_grad()
    def sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, n: int, max_new_tokens: int,
               temperature: float, top_k: int, top_p: float, eos_id: int,
               pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Same interface and result layout as :func:`relax_hpc.rollout.decode.sample` (finished rows padded;
        up to ``check_every - 1`` trailing columns past the last EOS may be all padding)."""
        s = _Sampling(float(temperature), int(top_k), float(top_p), int(eos_id), int(pad_id))
        prompts, width = input_ids.shape
        rows = prompts * n
        self._alloc(rows, -(-(width + max_new_tokens) // SPAN) * SPAN)
        self._prefill(input_ids, attention_mask, n, s)
        b, t = rows, 1
        while t < max_new_tokens:
            if t % self.check_every == 0:
                active = int((~self.done[:b]).sum())
                if active == 0:
                    break
                if self.compact:
                    b = self._shrink(b, active)
            n_run = min(self.check_every - t % self.check_every, max_new_tokens - t)  # up to the next check
            span = min(self.length, -(-(width + t + n_run - 1) // SPAN) * SPAN)
            self._run(b, span, n_run, s)
            t += n_run
        if not self.compact or b == rows:
            order = slice(0, rows)
            return self.hist_tok[order, :t].clone(), self.hist_lp[order, :t].clone()
        toks = torch.empty((rows, t), dtype=torch.long, device=self.device)
        lps = torch.empty((rows, t), dtype=torch.float32, device=self.device)
        toks[self.slot_row[:rows]] = self.hist_tok[:rows, :t]
        lps[self.slot_row[:rows]] = self.hist_lp[:rows, :t]
        return toks, lps


def _pre_attention(layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope: Any,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer up to its attention, for one new token per row: (q, k, v) ``[b, heads, 1, head_dim]``."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    shape = (x.shape[0], 1, -1, head_dim)
    q = attn.q_proj(h).view(shape)
    k = attn.k_proj(h).view(shape)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = attn.v_proj(h).view(shape).transpose(1, 2)
    q, k = rope(q, k, cos, sin)
    return q, k, v


def _post_attention(layer: Any, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The rest of a decoder layer after its attention output ``o`` ``[b, 1, heads * head_dim]``."""
    x = x + layer.self_attn.o_proj(o)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def layer_parts(compiled: bool) -> tuple[Any, Any]:
    """The two halves of a decode layer around the cache writes and the attention: plain, or (``rollout.hf_decoder:
    compiled``) each ``torch.compile``d with dynamic shapes, so their small elementwise kernels (norms, RoPE, residual
    adds, SiLU x up) fuse; the graph capture then records the compiled kernels. A compile failure runs them eagerly."""
    if not compiled:
        return _pre_attention, _post_attention
    from relax_hpc.models.compiled import CompiledFn, Fallback

    state = Fallback()  # both halves eager after either fails to compile, one warning
    return (CompiledFn(_pre_attention, "rollout.hf_decoder=compiled", state),
            CompiledFn(_post_attention, "rollout.hf_decoder=compiled", state))


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) ``[B, kv_heads, width, head_dim]`` per layer of a transformers dynamic cache."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return list(zip(cache.key_cache, cache.value_cache))


def graph_decoder(owner: Any) -> GraphDecoder | None:
    """The :class:`GraphDecoder` kept on ``owner`` (an engine; its graphs and state live as long as the engine) for
    ``owner.model``, or None where it does not apply (not on CUDA, or a model :func:`supported` refuses)."""
    model = owner.model
    held = _DECODERS.get(owner)  # (model, decoder or None)
    if held is None or held[0] is not model:
        p = next(model.parameters(), None)
        ok = p is not None and p.is_cuda and supported(model)
        held = (model, GraphDecoder(model, compiled=getattr(owner, "compile_decode", False)) if ok else None)
        _DECODERS[owner] = held
    return held[1]


_DECODERS: weakref.WeakKeyDictionary[Any, tuple[Any, GraphDecoder | None]] = weakref.WeakKeyDictionary()
"""owner -> (its model, the decoder kept for it): gone with the owner."""
