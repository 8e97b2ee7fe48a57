"""A fixed pool of decode slots over a static KV cache: the ``hf`` engine's decoder when requests keep arriving
(a fully_async worker, eval, GenRM), so that a row that finishes hands its slot to the next queued request instead
of idling until the longest row of its batch ends.

- **static state** (``slots`` rows x ``length`` cache columns): per-layer keys/values ``[slots, kv_heads, length,
  head_dim]`` and, per slot, the next position, the last token, the tokens generated, the budget, the sampling
  settings (temperature, top-k, top-p, stop ids), a sampling key and the token / log-prob / version history. Shapes
  never change while requests come and go, so on CUDA the steps between two checks are captured once per (attention
  span, steps, variant) as one CUDA graph and replayed, whichever requests occupy the slots;
- **per-row positions and masks**: a slot's context starts at column 0 of its cache row; a step writes each row's
  new key/value at that row's own column and masks the columns past it, so rows of any lengths share a step;
- **admission between steps**: the engine hands queued rows to free slots; their contexts (deduplicated: the ``n``
  samples of a prompt read it once) are prefilled together by the model's own forward (right-padded), their caches
  copied into the slots, and their first token drawn;
- **per-row sampling**: temperature, top-k and top-p per row (``decode.warp``'s order and semantics), the log-prob
  under ``logits / temperature`` as the other loops record it; the draw is the inverse CDF at a uniform number that
  depends only on the row's key (request seed, sample index) and its token index, so a request's tokens do not
  depend on which other requests share the pool (the same request decoded alone gives the same tokens), and the
  draw is captured inside a graph without a generator;
- **versions**: every token records the weight version the engine held when it was generated.

Applies to the models :func:`relax_hpc.rollout.graph_decode.supported` accepts (Llama-style decoders).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from relax_hpc.rollout.decode import cache_kwarg, new_cache
from relax_hpc.rollout.graph_decode import SPAN, cache_layers, layer_parts

M32 = 0xFFFFFFFF
LOW_OCCUPANCY = 0.25
"""Decode time with fewer than this share of rows active is counted apart (``perf/decode_low_occupancy_time``)."""


# ------------------------------------------------------------------------------------------------ the row keys
def mix32(x: int) -> int:
    """A 32-bit integer hash (xor-shift-multiply); :func:`_mix32_t` is the same on tensors."""
    x &= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x2C1B3C6D) & M32
    x ^= x >> 16
    return x


def _mix32_t(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` of an int64 tensor of values in [0, 2**32) (every product stays below 2**63)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & M32
    return x ^ (x >> 16)


def row_key(seed: int, sample: int) -> int:
    """The sampling key of sample ``sample`` of a request seeded with ``seed``."""
    return mix32(mix32(seed & M32) ^ mix32((seed >> 32) & M32) ^ mix32(sample + 0x9E3779B9))


def uniforms(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One uniform number in (0, 1) per row from its key and its token index (float32, 24 bits)."""
    h = _mix32_t((keys + _mix32_t(index & M32)) & M32)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


# ------------------------------------------------------------------------------------------------ rows
@dataclass
class RowSpec:
    """One row the engine admits: a context to continue, its budget and sampling settings."""

    context: Sequence[int]
    budget: int
    temperature: float
    top_k: int
    top_p: float
    stops: tuple[int, ...]
    """Token ids that end the row (kept in its tokens): EOS and the request's stop ids."""
    key: int
    """:func:`row_key` of the row."""
    group: int
    """Rows with the same group share their context (read once by the prefill)."""
    tag: Any = None
    """The engine's handle, returned with the row's result."""


@dataclass
class Finished:
    tag: Any
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    reason: Literal["stop", "length", "abort"]


@dataclass
class Occupancy:
    """Decode steps and the rows active in them, over a window (read and reset by :meth:`take`); the engine's
    thread adds, the worker's loop takes."""

    row_steps: float = 0.0
    """Sum over decode steps of the rows active in the step."""
    slot_steps: float = 0.0
    """Sum over decode steps of the rows the step computed (active or not)."""
    steps: float = 0.0
    seconds: float = 0.0
    low_seconds: float = 0.0
    """Decode seconds with fewer than ``LOW_OCCUPANCY`` of the rows active."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, active_row_steps: float, rows: int, steps: int, seconds: float, low: bool) -> None:
        """``steps`` decode steps over ``rows`` rows in ``seconds``, ``active_row_steps`` of them active."""
        self._add(active_row_steps, rows * steps, steps, seconds, seconds if low else 0.0)

    def add_batch(self, lengths: np.ndarray, steps: int, seconds: float) -> None:
        """A static batch of ``len(lengths)`` rows that ran ``steps`` decode steps in ``seconds``: row ``r`` was
        active for ``lengths[r]`` of them; the steps with fewer than a quarter of the rows active count as low."""
        rows = len(lengths)
        if rows == 0 or steps <= 0:
            return
        active = (np.asarray(lengths)[None, :] > np.arange(steps)[:, None]).sum(axis=1)
        low = int((active < LOW_OCCUPANCY * rows).sum())
        self._add(float(active.sum()), rows * steps, steps, seconds, seconds * low / steps)

    def _add(self, row_steps: float, slot_steps: float, steps: float, seconds: float, low_seconds: float) -> None:
        with self.lock:
            self.row_steps += row_steps
            self.slot_steps += slot_steps
            self.steps += steps
            self.seconds += seconds
            self.low_seconds += low_seconds

    def take(self) -> dict[str, float]:
        """The window's metrics (none when nothing was decoded), then a new window."""
        with self.lock:
            if not self.slot_steps:
                return {}
            out = {"perf/decode_occupancy": self.row_steps / self.slot_steps, "perf/decode_steps": self.steps,
                   "perf/decode_time": self.seconds, "perf/decode_low_occupancy_time": self.low_seconds}
            self.row_steps = self.slot_steps = self.steps = self.seconds = self.low_seconds = 0.0
            return out


# ------------------------------------------------------------------------------------------------ the pool
@dataclass(frozen=True)
class _Variant:
    rows: int
    """The step computes slots [0, rows) (a bucket: the pool's size or a power of two below it)."""
    span: int
    steps: int
    cut: bool
    """Some row has a top-k or top-p cut (the sorts run only then)."""


class SlotPool:
    """The static decode state of ``slots`` rows of one model (see the module docstring)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    hist_tok: torch.Tensor
    hist_lp: torch.Tensor
    hist_ver: torch.Tensor
    stops: torch.Tensor

    def __init__(self, model: Any, slots: int, *, length: int, pad_id: int, use_graphs: bool | None = None,
                 check_every: int | None = None, compiled: bool = False, occupancy: Occupancy | None = None):
        import sys

        p = next(model.parameters())
        self.model, self.inner = model, model.model
        self.device, self.dtype = p.device, p.dtype
        cuda = self.device.type == "cuda"
        self.use_graphs = cuda if use_graphs is None else use_graphs
        self.check_every = check_every or (8 if cuda else 4)
        self.slots, self.pad_id = int(slots), int(pad_id)
        self.layers = list(self.inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim, self.scaling = int(attn.head_dim), float(attn.scaling)
        cfg = model.config
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        self.q_heads = int(cfg.num_attention_heads)
        self.rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self._pre, self._post = layer_parts(compiled)
        self.graphs: dict[_Variant, Any] = {}
        self._pool: Any = None
        self._stream: Any = None
        self.captures = 0
        self.length = 0
        self.stop_width = 0
        self.tags: list[Any] = [None] * self.slots
        """The tag of the row in each slot (None: free)."""
        self.stops_of: list[tuple[int, ...]] = [()] * self.slots
        self.cut_of = [False] * self.slots
        """Per slot: its row has a top-k or top-p cut."""
        self.occupancy = occupancy or Occupancy()
        self.compact = True
        """Move the occupied slots to the front when they fill at most half of their bucket."""
        self.compactions = 0
        self._alloc(max(SPAN, _round(length)), 4)

    # ------------------------------------------------------------------ state
    def _alloc(self, length: int, stop_width: int) -> None:
        """Allocate (or grow, keeping the rows in flight) the static state; captured graphs are dropped."""
        s, dev = self.slots, self.device
        old = self.__dict__.get("k")
        shape = (s, self.kv_heads, length, self.head_dim)
        k = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in self.layers]
        v = [torch.zeros(shape, dtype=self.dtype, device=dev) for _ in self.layers]
        hist = (torch.full((s, length), self.pad_id, dtype=torch.long, device=dev),
                torch.zeros((s, length), dtype=torch.float32, device=dev),
                torch.zeros((s, length), dtype=torch.int32, device=dev))
        stops = torch.full((s, stop_width), -1, dtype=torch.long, device=dev)
        if old is not None:
            w = self.length
            for new, cur in zip((*k, *v), (*self.k, *self.v)):
                new[:, :, :w] = cur
            for new, cur in zip(hist, (self.hist_tok, self.hist_lp, self.hist_ver)):
                new[:, :w] = cur
            stops[:, :self.stop_width] = self.stops
        else:
            self.pos = torch.zeros(s, dtype=torch.long, device=dev)
            self.last = torch.zeros(s, dtype=torch.long, device=dev)
            self.gen = torch.zeros(s, dtype=torch.long, device=dev)
            self.budget = torch.ones(s, dtype=torch.long, device=dev)
            self.done = torch.ones(s, dtype=torch.bool, device=dev)
            self.temp = torch.ones(s, dtype=torch.float32, device=dev)
            self.greedy = torch.zeros(s, dtype=torch.bool, device=dev)
            self.top_k = torch.zeros(s, dtype=torch.long, device=dev)
            self.top_p = torch.ones(s, dtype=torch.float32, device=dev)
            self.keys = torch.zeros(s, dtype=torch.long, device=dev)
            self.version = torch.zeros(1, dtype=torch.int32, device=dev)
            self.rows = torch.arange(s, device=dev)
        self.k, self.v = k, v
        self.hist_tok, self.hist_lp, self.hist_ver = hist
        self.stops = stops
        self.cols = torch.arange(length, device=dev)
        self.length, self.stop_width = length, stop_width
        self.graphs.clear()
        if self.use_graphs and self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device=dev)

    def release(self) -> None:
        """Drop the captured graphs (the state stays; they are captured again as needed)."""
        self.graphs.clear()

    def set_version(self, version: int) -> None:
        self.version.fill_(int(version))

    # ------------------------------------------------------------------ queries
    def free(self) -> list[int]:
        return [i for i, t in enumerate(self.tags) if t is None]

    def busy(self) -> list[int]:
        return [i for i, t in enumerate(self.tags) if t is not None]

    @property
    def active(self) -> int:
        return self.slots - len(self.free())

    # ------------------------------------------------------------------ sampling
    def _draw(self, logits: torch.Tensor, rows: torch.Tensor | slice, cut: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, its log-prob under logits / temperature) of each row in ``rows``."""
        temp, greedy = self.temp[rows], self.greedy[rows]
        scores = logits / temp[:, None]
        vocab = scores.shape[-1]
        if cut:
            k = torch.where((self.top_k[rows] > 0) & (self.top_k[rows] < vocab), self.top_k[rows], vocab)
            kth = torch.sort(scores, dim=-1, descending=True)[0].gather(1, (k - 1)[:, None])
            scores = scores.masked_fill(scores < kth, -float("inf"))
            asc, idx = torch.sort(scores, descending=False)
            remove = asc.softmax(dim=-1).cumsum(dim=-1) <= (1 - self.top_p[rows])[:, None]
            remove[..., -1:] = False  # keep at least one token
            scores = scores.masked_fill(remove.scatter(1, idx, remove), -float("inf"))
        cdf = scores.softmax(dim=-1).cumsum(dim=-1)
        u = uniforms(self.keys[rows], self.gen[rows])
        drawn = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp_max(vocab - 1)
        tok = torch.where(greedy, logits.argmax(dim=-1), drawn)
        lp = torch.log_softmax(logits / temp[:, None], dim=-1).gather(-1, tok[:, None])[:, 0]
        return tok, lp

    def _record(self, rows: torch.Tensor | slice, tok: torch.Tensor, lp: torch.Tensor) -> None:
        """Write each row's token at its index, count it, end rows on a stop id or their budget."""
        done, gen = self.done[rows], self.gen[rows]
        live = ~done
        tok = torch.where(live, tok, torch.full_like(tok, self.pad_id))
        idx = self.rows[rows]
        self.hist_tok[idx, gen] = tok
        self.hist_lp[idx, gen] = lp
        self.hist_ver[idx, gen] = self.version.expand_as(gen)
        ended = (tok[:, None] == self.stops[rows]).any(dim=-1) | (gen + 1 >= self.budget[rows])
        self.gen[rows] = gen + live.long()
        done = done | (live & ended)
        self.done[rows] = done
        self.pos[rows] = self.pos[rows] + (~done).long()
        self.last[rows] = tok

    # ------------------------------------------------------------------ the step
    def _layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: int, span: int,
               mask: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        q, k, v = self._pre(layer, x, cos, sin, self.rope, self.head_dim)
        self.k[i][self.rows[:b], :, self.pos[:b]] = k[:, :, 0]
        self.v[i][self.rows[:b], :, self.pos[:b]] = v[:, :, 0]
        qg = q.reshape(b, self.kv_heads, self.q_heads // self.kv_heads, self.head_dim)
        o = torch.nn.functional.scaled_dot_product_attention(
            qg, self.k[i][:b, :, :span], self.v[i][:b, :, :span], attn_mask=mask, scale=self.scaling)
        return self._post(layer, x, o.reshape(b, 1, self.q_heads * self.head_dim))

    def _step(self, b: int, span: int, cut: bool) -> None:
        """One decode step of slots [0, b), reading ``span`` cache columns; touches only static state."""
        x = self.inner.embed_tokens(self.last[:b, None])
        cos, sin = self.inner.rotary_emb(x, self.pos[:b, None])
        mask = torch.zeros((b, 1, 1, span), dtype=x.dtype, device=x.device).masked_fill_(
            (self.cols[None, :span] > self.pos[:b, None])[:, None, None, :], float("-inf"))
        for i in range(len(self.layers)):
            x = self._layer(i, x, cos, sin, b, span, mask)
        logits = self.model.lm_head(self.inner.norm(x))[:, 0].float()
        rows = slice(0, b)
        tok, lp = self._draw(logits, rows, cut)
        self._record(rows, tok, lp)

    def _steps(self, var: _Variant) -> None:
        for _ in range(var.steps):
            self._step(var.rows, var.span, var.cut)

    def _replay(self, var: _Variant) -> None:
        """``var.steps`` steps: eagerly, or replayed from their CUDA graph (captured after one real run)."""
        if not self.use_graphs:
            self._steps(var)
            return
        g = self.graphs.get(var)
        if g is not None:
            g.replay()
            return
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._steps(var)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            self._steps(var)
        self.graphs[var] = g
        self.captures += 1

    # ------------------------------------------------------------------ admission
    def _fit(self, rows: Sequence[RowSpec]) -> None:
        need = max(len(r.context) + r.budget + 1 for r in rows)
        width = max(len(r.stops) for r in rows)
        if need > self.length or width > self.stop_width:
            self._alloc(max(self.length, _round(need)), max(self.stop_width, width))

    @torch.no_grad()
    def admit(self, rows: Sequence[RowSpec]) -> list[Finished]:
        """Place ``rows`` in free slots (at most as many as are free): prefill their contexts, draw their first
        token. Returns the rows that already ended (a stop id first, or a budget of one)."""
        if not rows:
            return []
        free = self.free()
        if len(rows) > len(free):
            raise ValueError(f"{len(rows)} rows for {len(free)} free slots")
        self._fit(rows)
        groups: dict[int, int] = {}
        contexts: list[Sequence[int]] = []
        for r in rows:
            if r.group not in groups:
                groups[r.group] = len(contexts)
                contexts.append(r.context)
        logits, caches = self._prefill(contexts)
        slots = free[:len(rows)]
        dev = self.device
        idx = torch.tensor(slots, dtype=torch.long, device=dev)
        grp = torch.tensor([groups[r.group] for r in rows], dtype=torch.long, device=dev)
        width = caches[0][0].shape[2]
        for i, (k, v) in enumerate(caches):
            self.k[i][idx, :, :width] = k[grp].to(self.dtype)
            self.v[i][idx, :, :width] = v[grp].to(self.dtype)
        self._set_rows(idx, rows)
        for slot, r in zip(slots, rows):
            self.tags[slot] = r.tag
            self.stops_of[slot] = r.stops
            self.cut_of[slot] = r.top_k > 0 or r.top_p < 1.0
        cut = any(r.top_k > 0 or r.top_p < 1.0 for r in rows)
        tok, lp = self._draw(logits[grp], idx, cut)
        self._record(idx, tok, lp)
        return self._harvest(slots)

    def _set_rows(self, idx: torch.Tensor, rows: Sequence[RowSpec]) -> None:
        def t(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        self.pos[idx] = t([len(r.context) - 1 for r in rows], torch.long)  # the first token's record moves it on
        self.gen[idx] = 0
        self.done[idx] = False
        self.budget[idx] = t([r.budget for r in rows], torch.long)
        self.greedy[idx] = t([r.temperature == 0 for r in rows], torch.bool)
        self.temp[idx] = t([r.temperature if r.temperature > 0 else 1.0 for r in rows], torch.float32)
        self.top_k[idx] = t([r.top_k for r in rows], torch.long)
        self.top_p[idx] = t([r.top_p for r in rows], torch.float32)
        self.keys[idx] = t([r.key & M32 for r in rows], torch.long)
        stops = np.full((len(rows), self.stop_width), -1, dtype=np.int64)
        for j, r in enumerate(rows):
            stops[j, :len(r.stops)] = r.stops
        self.stops[idx] = torch.from_numpy(stops).to(self.device)

    def _prefill(self, contexts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[tuple[Any, Any]]]:
        """The contexts through the model's own forward, right-padded: (last logits ``[U, V]`` float32, per-layer
        (keys, values) ``[U, kv_heads, width, head_dim]``)."""
        lengths = np.array([len(c) for c in contexts], dtype=np.int64)
        width = int(lengths.max())
        ids = np.full((len(contexts), width), self.pad_id, dtype=np.int64)
        for j, c in enumerate(contexts):
            ids[j, :len(c)] = c
        attn = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        dev = self.device
        positions = torch.arange(width, device=dev)[None, :].expand(len(contexts), width)
        cache = new_cache(self.model)
        cache_arg = {cache_kwarg(self.model) or "past_key_values": cache}
        out = self.inner(input_ids=torch.from_numpy(ids).to(dev), attention_mask=torch.from_numpy(attn).to(dev),
                         position_ids=positions, use_cache=True, **cache_arg)
        last = out.last_hidden_state[torch.arange(len(contexts), device=dev), torch.from_numpy(lengths - 1).to(dev)]
        return self.model.lm_head(last).float(), cache_layers(cache)

    # ------------------------------------------------------------------ running
    @torch.no_grad()
    def run(self, steps: int | None = None) -> list[Finished]:
        """Up to ``steps`` (default ``check_every``) decode steps of the occupied slots; returns the rows that ended.
        The steps compute the smallest bucket of slots that holds every occupied one; when the occupied slots fill
        at most half of their bucket (the tail, once no request is queued), they move to the front first."""
        busy = self.busy()
        if not busy:
            return []
        if self.compact and len(busy) <= _bucket(busy[-1] + 1, self.slots) // 2:
            busy = self._compact(busy)
        n = steps or self.check_every
        b = _bucket(busy[-1] + 1, self.slots)
        before = self.gen[:b].clone()
        state = torch.stack([self.done[:b].long(), self.pos[:b]]).cpu().numpy()
        live = [i for i in busy if not state[0, i]]
        top = int(state[1, live].max()) if live else 0
        cut = any(self.cut_of[i] for i in live)
        var = _Variant(rows=b, span=min(self.length, _round(top + n)), steps=n, cut=cut)
        t0 = time.perf_counter()
        self._replay(var)
        finished = self._harvest(busy)
        seconds = time.perf_counter() - t0
        row_steps = float((self.gen[:b] - before).sum())
        # against the pool's size: a step with few rows runs a smaller bucket, but still far below a full batch
        self.occupancy.add(row_steps, self.slots, n, seconds, len(live) < LOW_OCCUPANCY * self.slots)
        return finished

    def _compact(self, busy: list[int]) -> list[int]:
        """Move the rows of ``busy`` to slots [0, len(busy)) (order kept), with their caches and state."""
        src = torch.tensor(busy, dtype=torch.long, device=self.device)
        dst = torch.arange(len(busy), device=self.device)
        for cache in (*self.k, *self.v):
            cache[dst] = cache[src]
        for st in (self.pos, self.last, self.gen, self.budget, self.done, self.temp, self.greedy, self.top_k,
                   self.top_p, self.keys, self.stops, self.hist_tok, self.hist_lp, self.hist_ver):
            st[dst] = st[src]
        self.done[len(busy):] = True
        rest = self.slots - len(busy)
        self.tags = [self.tags[i] for i in busy] + [None] * rest
        self.stops_of = [self.stops_of[i] for i in busy] + [()] * rest
        self.cut_of = [self.cut_of[i] for i in busy] + [False] * rest
        self.compactions += 1
        return list(range(len(busy)))

    def _harvest(self, slots: Sequence[int], *, abort: bool = False) -> list[Finished]:
        """The rows in ``slots`` that ended (all of them with ``abort``) as results; their slots are freed."""
        if not slots:
            return []
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        state = torch.stack([self.done[idx].long(), self.gen[idx]]).cpu().numpy()
        ended = [j for j in range(len(slots)) if abort or state[0, j]]
        if not ended:
            return []
        take = idx[ended]
        width = int(state[1, ended].max()) if ended else 0
        toks = self.hist_tok[take, :width].to(torch.int32).cpu().numpy()
        lps = self.hist_lp[take, :width].cpu().numpy()
        vers = self.hist_ver[take, :width].cpu().numpy()
        out = []
        for row, j in enumerate(ended):
            slot, n = slots[j], int(state[1, j])
            stopped = n > 0 and int(toks[row, n - 1]) in self.stops_of[slot]
            reason: Literal["stop", "length", "abort"] = "stop" if stopped else (
                "length" if state[0, j] else "abort")
            out.append(Finished(self.tags[slot], toks[row, :n].copy(), lps[row, :n].copy(), vers[row, :n].copy(),
                                reason))
            self.tags[slot] = None
            self.stops_of[slot] = ()
        self.done[take] = True
        return out

    def evict(self, slots: Sequence[int]) -> list[Finished]:
        """End the rows in ``slots`` now (aborted requests): their tokens so far, reason ``abort`` for rows still
        running."""
        return self._harvest(list(slots), abort=True)


def _bucket(n: int, slots: int) -> int:
    """The smallest of ``slots`` and the powers of two that is >= ``n``."""
    b = 1
    while b < n:
        b *= 2
    return min(b, slots)


def _round(n: int) -> int:
    return -(-int(n) // SPAN) * SPAN
