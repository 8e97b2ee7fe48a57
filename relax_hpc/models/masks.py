"""Ready 4-D attention masks for SDPA models: the decode loop's and the trainer's packed rows.

Transformers builds a 4-D mask from a 2-D one (or from packed position ids) at every forward; on small models (the
demo's, CPU runs) that Python costs as much as the layers. A ready boolean mask ``[rows, 1, queries, keys]`` (True
= attend) is passed to SDPA as it is. Only for models whose every layer attends causally over the whole context with
SDPA (:func:`own_masks`); the others build their own (sliding windows, eager, flash kernels).
"""

from __future__ import annotations

from typing import Any

import torch


def own_masks(model: Any) -> bool:
    """True when ``model`` takes ready 4-D boolean masks: SDPA, full attention in every layer, no sliding window."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "_attn_implementation", None) != "sdpa":
        return False
    if getattr(cfg, "sliding_window", None) is not None:
        return False
    return all(t == "full_attention" for t in (getattr(cfg, "layer_types", None) or ()))


def prompt_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """The prefill's mask of left-padded prompts (``attention_mask`` [rows, W], 1 = token): causal within the row,
    padding never attended; a padding query attends to itself only (a query with nothing to attend to would give
    SDPA a row of NaNs, which would reach the real tokens' keys and values in the next layer)."""
    width = attention_mask.shape[-1]
    causal = torch.ones((width, width), dtype=torch.bool, device=attention_mask.device).tril()
    own = torch.eye(width, dtype=torch.bool, device=attention_mask.device)
    return ((causal[None] & attention_mask.bool()[:, None, :]) | own[None])[:, None]


def packed_mask(position_ids: torch.Tensor) -> torch.Tensor | None:
    """The block-diagonal causal mask of rows of packed sequences (``position_ids`` [rows, W] restart at each
    sequence; a sequence starts wherever a position is not the previous one + 1, as transformers finds packed
    sequences). None when no row holds more than one sequence: the model's causal path needs no mask."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    seq = starts.cumsum(-1)
    width = position_ids.shape[-1]
    causal = torch.ones((width, width), dtype=torch.bool, device=position_ids.device).tril()
    return ((seq[:, :, None] == seq[:, None, :]) & causal[None])[:, None]
