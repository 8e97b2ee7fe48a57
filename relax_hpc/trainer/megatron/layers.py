"""The pieces of the megatron backend that megatron-core's local layer spec lacks (imported only by the backend).

- :class:`Packing`: the packed micro-batches the GPT runs on (sequence boundaries on the model's device, given to
  the GPT as its ``attention_mask``; the longest sequence; every token's position), shared by the GPT's core
  attention modules and its RoPE. The GPT is called without megatron's ``packed_seq_params`` (one [tokens, 1]
  sequence to megatron), so megatron-core's THD paths stay out: its RoPE would split the row per sequence in every
  layer (a dozen small kernels per sequence, and a host round trip of the boundaries), and every boundary copy to
  the GPU would wait for the GPU's queue.
- :func:`position_rope`: the GPT's RoPE frequencies gathered at each token's position (one indexing kernel), which
  megatron-core then applies to the whole row at once.
- :class:`PackedCoreAttention`: causal attention within each sequence of the boundaries, which megatron-core's
  local ``DotProductAttention`` cannot do: causal ``scaled_dot_product_attention`` per sequence (GQA through
  ``enable_gqa``; no [T, T] mask; the same kernel call as the HF model's on one sequence), or on a GPU in half
  precision one call of torch's flash varlen kernel (``torch.nn.attention.varlen``, torch >= 2.10) where this torch
  has it. It is left out of ``torch.compile`` (``trainer.compile_layers`` compiles the layer around it).
- :func:`vocab_parallel_logprobs`: per-token log-probs (and entropies) from vocabulary-parallel logits: each
  tensor-parallel rank holds ``V / tp`` columns; the padded columns (beyond the model's vocabulary) are masked out,
  so the log-probs are the HF model's; every reduction over the vocabulary is an all-reduce over the TP group
  (differentiable: megatron's ``reduce_from_tensor_model_parallel_region``). Tokens are processed in chunks, so
  no float32 copy of the whole ``[tokens, V / tp]`` logits is made beyond one chunk's.
- :func:`cpu_shim`: megatron-core 0.16 moves the RoPE frequencies to ``torch.cuda.current_device()``; on a
  machine without CUDA that call raises, and returns ``"cpu"`` after the shim; recompute's CUDA RNG bookkeeping
  finds an empty state.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.module import MegatronModule

CHUNK_TOKENS = 4096
"""Tokens per chunk of :func:`vocab_parallel_logprobs`."""


def cpu_shim() -> None:
    """Where torch has no CUDA: ``torch.cuda.current_device()`` returns ``"cpu"`` (it raises otherwise), and
    megatron's recompute (``tensor_parallel.checkpoint``), which saves and restores the CUDA RNG state around each
    recomputed layer, finds an empty one (the models here have no dropout; the CPU RNG is still restored)."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


class Packing:
    """The packed sequences of the micro-batches the GPT runs on. :meth:`use` makes a micro-batch's boundaries
    ``cu`` [n + 1] (int32, on the model's device), which the caller hands the GPT as its ``attention_mask``: megatron
    passes it to every layer's attention unchanged and saves it with a recomputed layer's inputs, so a layer run
    again in the backward pass (recompute, or a pipeline's later backward) finds its own micro-batch's boundaries.
    The host side of each (the boundaries and the longest length, which the kernels need on the host) is kept by the
    tensor's address for the last :data:`KEEP` micro-batches. ``positions`` [T] (every token's position within its
    sequence) is read by :func:`position_rope` while :meth:`use` is in force."""

    KEEP = 256

    def __init__(self) -> None:
        self.positions: torch.Tensor | None = None
        self.longest = 0
        self._host: collections.OrderedDict[int, tuple[torch.Tensor, int]] = collections.OrderedDict()

    @contextlib.contextmanager
    def use(self, lengths: list[int], positions: torch.Tensor) -> Iterator[torch.Tensor]:
        """The boundaries of sequences of ``lengths`` packed in one row whose positions are ``positions`` [T]
        (restarting at 0 in each sequence), to pass as the GPT's ``attention_mask`` inside this block."""
        host = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        device = positions.device
        cu = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        self._host[cu.data_ptr()] = (host, max(lengths))
        while len(self._host) > self.KEEP:
            self._host.popitem(last=False)
        self.positions, self.longest = positions, max(lengths)
        try:
            yield cu
        finally:
            self.positions, self.longest = None, 0

    def host(self, cu: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(boundaries on the host, longest length) of boundaries ``cu`` that :meth:`use` made."""
        found = self._host.get(cu.data_ptr())
        if found is None or found[0].numel() != cu.numel():
            raise RuntimeError("packed-sequence boundaries the Packing did not make (or made too long ago)")
        return found


def position_rope(rope: torch.nn.Module, packing: Packing) -> None:
    """``rope`` (the GPT's ``RotaryEmbedding``) returns its frequencies at each token's position [T, 1, 1, d] while
    ``packing`` is in use (an instance ``forward`` over the class's; the plain one otherwise)."""
    plain = rope.forward

    def forward(max_seq_len: int, *args: Any, **kwargs: Any) -> torch.Tensor:
        if packing.positions is None:
            return plain(max_seq_len, *args, **kwargs)
        return plain(packing.longest, *args, **kwargs)[packing.positions]

    rope.forward = forward  # type: ignore[method-assign]


class PackedCoreAttention(MegatronModule):
    """Causal attention within each packed sequence (``query`` [T, 1, heads, d], ``key``/``value``
    [T, 1, groups, d], SBHD with batch 1); returns [T, 1, heads * d]. The sequences' boundaries come as
    ``attention_mask`` (:meth:`Packing.use`); without them (None) the input is one sequence. The GPT's builder
    sets :attr:`packing` (one per GPT)."""

    packing: Packing | None = None

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None):
        super().__init__(config=config)
        self.softmax_scale = softmax_scale

    @torch.compiler.disable
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        assert attention_bias is None, "attention bias is not supported"
        assert packed_seq_params is None, "packed sequences come as the Packing's boundaries, not packed_seq_params"
        assert query.shape[1] == 1, "the input must have batch 1 (one packed row)"
        query, key, value = query[:, 0], key[:, 0], value[:, 0]
        if attention_mask is not None:
            assert self.packing is not None, "the GPT's builder gives its attention modules the Packing"
            cu = attention_mask
            host, longest = self.packing.host(cu)
        else:
            host = torch.tensor([0, query.shape[0]], dtype=torch.int32)
            cu, longest = host.to(query.device), query.shape[0]
        out = varlen_causal(query, key, value, cu, longest, self.softmax_scale)
        if out is None:
            out = sdpa_per_sequence(query, key, value, host, self.softmax_scale)
        return out.reshape(query.shape[0], 1, -1)


def sdpa_per_sequence(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor,
                      scale: float | None) -> torch.Tensor:
    """Causal ``scaled_dot_product_attention`` on each sequence of ``cu`` ([T, heads, d] in and out)."""
    gqa = key.shape[1] != query.shape[1]
    outs = [torch.nn.functional.scaled_dot_product_attention(
        query[a:b].transpose(0, 1), key[a:b].transpose(0, 1), value[a:b].transpose(0, 1), is_causal=True,
        scale=scale, enable_gqa=gqa) for a, b in itertools.pairwise(cu.tolist())]
    return torch.cat(outs, dim=1).transpose(0, 1)


def varlen_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor, longest: int,
                  scale: float | None) -> torch.Tensor | None:
    """Causal attention within each sequence of ``cu`` (on ``query``'s device; ``longest`` its longest) in one call
    of torch's flash varlen kernel ([T, heads, d]), or None where it does not apply: not CUDA, not half precision, or
    a torch without it (< 2.10). torch 2.10 takes ``is_causal``, later ones ``window_size=(-1, 0)``; key/value heads
    are repeated for GQA where the kernel has no ``enable_gqa``."""
    if not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16):
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kw: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "window_size" not in params and "is_causal" not in params:
        return None
    if scale is not None:
        if "scale" not in params:
            return None
        kw["scale"] = scale
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    return varlen_attn(query.contiguous(), key.contiguous(), value.contiguous(), cu, cu, longest, longest, **kw)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, tp_rank: int,
                            tp_group: Any, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` [T] (and entropies [T]) from this TP rank's logits [T, V / tp] (float32 math)."""
    logp, ent = [], []
    for s in range(0, logits.shape[0], CHUNK_TOKENS):
        lp, e = _chunk(logits[s:s + CHUNK_TOKENS], targets[s:s + CHUNK_TOKENS], vocab_size, tp_rank, tp_group,
                       with_entropy)
        logp.append(lp)
        ent.append(e)
    if not logp:
        empty = logits.new_zeros(0, dtype=torch.float32)
        return empty, empty if with_entropy else None
    return torch.cat(logp), torch.cat(ent) if with_entropy else None  # type: ignore[arg-type]


def _chunk(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, tp_rank: int, group: Any,
           with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    import torch.distributed as dist

    width = logits.shape[-1]
    start = tp_rank * width
    pad = torch.arange(start, start + width, device=logits.device) >= vocab_size
    z = logits.float().masked_fill(pad, float("-inf"))
    m = z.detach().max(-1).values
    if group.size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    shifted = z - m[:, None]
    log_sum = torch.log(reduce_from_tensor_model_parallel_region(shifted.exp().sum(-1), group))
    local = targets - start
    mine = (local >= 0) & (local < width)
    picked = shifted.gather(-1, local.clamp(0, width - 1)[:, None])[:, 0]
    logp = reduce_from_tensor_model_parallel_region(torch.where(mine, picked, 0.0), group) - log_sum
    if not with_entropy:
        return logp, None
    p = (shifted - log_sum[:, None]).exp()
    mean_shifted = reduce_from_tensor_model_parallel_region((p * shifted.masked_fill(pad, 0.0)).sum(-1), group)
    return logp, log_sum - mean_shifted
