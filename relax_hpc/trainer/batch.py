"""What the trainer consumes, and packing into micro-batches without padding.

A :class:`TrainItem` is one sample (prompt + response) with everything the loss needs. :func:`pack` groups items into
micro-batches of at most ``max_tokens`` tokens (first-fit decreasing), each laid out as ``R`` rows of ``W`` tokens
with position ids that restart at every sequence; HF models build a block-diagonal causal mask from the position ids
(no attention across sequences). The tail of a row that no sequence fills is padding (its own position run, never
read); the row width is chosen per micro-batch by a cost model of padding against attention (``padding_fraction`` is
reported). One row (``R = 1``) has no padding at all but attention over the whole row; several short rows cost far
less attention on CPUs and small models.

Shapes (one micro-batch, S sequences, R rows of W tokens, T response tokens):
    input_ids, position_ids  [R, W]
    logit_index              [T]  flat index (row * W + column) of the position whose logits predict each token
    targets                  [T]  the response tokens
    seq_ids                  [T]  which of the S sequences each response token belongs to
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_ATTN_SCALE = 6.0 * 64
"""``attn_scale`` of :func:`choose_row_width` for a model of hidden size 64 (the trainer passes 6 x its own)."""


@dataclass
class TrainItem:
    """One sample as the trainer sees it."""

    prompt_ids: np.ndarray
    """[P] int prompt token ids."""
    response_ids: np.ndarray
    """[R] int response token ids."""
    rollout_logprobs: np.ndarray
    """[R] float log-probs recorded by the rollout engine."""
    loss_mask: np.ndarray
    """[R] 0/1: tokens that count in the loss (tool/environment tokens are 0)."""
    advantage: float = 0.0
    """Sequence advantage (filled by the algorithm before packing)."""
    reward: float = 0.0
    """Scalar reward."""
    version: int = 0
    """Policy version that generated the sample."""
    group_id: str = ""
    """Prompt group."""
    weight: float = 1.0
    """Extra per-sample weight (e.g. staleness re-weighting)."""
    multimodal: dict[str, Any] = field(default_factory=dict)
    """Named model inputs (pixel_values ...) as torch tensors or numpy arrays: such items get a micro-batch of their
    own."""
    token_advantages: np.ndarray | None = None
    """[R] per-token advantages (distillation); overrides ``advantage`` when set."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class MicroBatch:
    """One packed row of sequences (torch tensors)."""

    input_ids: Any
    position_ids: Any
    logit_index: Any
    targets: Any
    seq_ids: Any
    rollout_logprobs: Any
    loss_mask: Any
    advantages: Any
    weights: Any
    items: list[TrainItem]
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    real_tokens: int = 0
    """Tokens of the sequences (the rest of the R x W layout is padding)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def plan_packs(lengths: list[int], max_tokens: int, *, alone: set[int] | None = None) -> list[list[int]]:
    """First-fit decreasing: indices grouped so each group's total length is <= max_tokens (a longer sequence gets a
    group of its own). Indices in ``alone`` always get a group of their own."""
    alone = alone or set()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    packs: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if i in alone:
            packs.append([i])
            room.append(-1)
            continue
        for k, r in enumerate(room):
            if r >= lengths[i]:
                packs[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            packs.append([i])
            room.append(max_tokens - lengths[i])
    return packs


def choose_row_width(lengths: list[int], max_tokens: int, *,
                     attn_scale: float = DEFAULT_ATTN_SCALE) -> tuple[int, list[list[int]]]:
    """Row width W and the rows (indices) of the cheapest layout among widths longest x 1, 2, 3 ... 16, then
    doubling, and one row of everything. A layout of R rows costs ``R * W * (1 + W / attn_scale)``: every slot pays
    the per-token work (padding too) and, with the block-diagonal mask built from the position ids, attention over
    its whole row. ``attn_scale`` ~ 6 x hidden size (per-token attention work over per-token matmul work)."""
    total = sum(lengths)
    longest = max(lengths)
    widths = [longest * k for k in range(1, 17) if longest * k < total]
    w = longest * 32
    while w < total:
        widths.append(w)
        w *= 2
    widths.append(total)
    best: tuple[float, int, list[list[int]]] | None = None
    for w in widths:
        rows = plan_packs(lengths, w)
        cost = len(rows) * w * (1.0 + w / attn_scale)
        if best is None or cost < best[0]:
            best = (cost, w, rows)
    assert best is not None
    return best[1], best[2]


def build_micro_batch(items: list[TrainItem], *, device: Any = "cpu", rows: bool = True,
                      attn_scale: float = DEFAULT_ATTN_SCALE) -> MicroBatch:
    """Lay ``items`` out as packed rows (``rows=False``: one row, no padding)."""
    import torch

    lengths = [it.num_tokens for it in items]
    if rows and len(items) > 1:
        width, layout = choose_row_width(lengths, sum(lengths), attn_scale=attn_scale)
    else:
        width, layout = sum(lengths), [list(range(len(items)))]
    n_rows = len(layout)
    row_of: dict[int, tuple[int, int]] = {}
    for r, members in enumerate(layout):
        col = 0
        for i in members:
            row_of[i] = (r, col)
            col += lengths[i]
    ids_t = np.zeros((n_rows, width), dtype=np.int64)
    pos_t = np.zeros((n_rows, width), dtype=np.int64)
    fill = [0] * n_rows
    logit_index, targets, seq_ids = [], [], []
    lp, mask, adv, w = [], [], [], []
    for s, it in enumerate(items):
        p, r = len(it.prompt_ids), len(it.response_ids)
        row, col = row_of[s]
        ids_t[row, col:col + p + r] = np.concatenate([it.prompt_ids, it.response_ids])
        pos_t[row, col:col + p + r] = np.arange(p + r)
        fill[row] = max(fill[row], col + p + r)
        logit_index.append(row * width + col + p - 1 + np.arange(r, dtype=np.int64))
        targets.append(np.asarray(it.response_ids, dtype=np.int64))
        seq_ids.append(np.full(r, s, dtype=np.int64))
        lp.append(np.asarray(it.rollout_logprobs, dtype=np.float32))
        mask.append(np.asarray(it.loss_mask, dtype=np.float32))
        adv.append(np.asarray(it.token_advantages, dtype=np.float32) if it.token_advantages is not None
                   else np.full(r, it.advantage, dtype=np.float32))
        w.append(np.full(r, it.weight, dtype=np.float32))
    for row in range(n_rows):  # the unused tail of a row is its own position run (never attended to by real tokens)
        pos_t[row, fill[row]:] = np.arange(width - fill[row])

    def t(parts: list[np.ndarray]) -> Any:
        return torch.from_numpy(np.concatenate(parts)).to(device)

    model_kwargs: dict[str, Any] = {}
    if len(items) == 1 and items[0].multimodal:
        model_kwargs = {k: torch.as_tensor(v).to(device) for k, v in items[0].multimodal.items()}
    return MicroBatch(input_ids=torch.from_numpy(ids_t).to(device), position_ids=torch.from_numpy(pos_t).to(device),
                      logit_index=t(logit_index), targets=t(targets), seq_ids=t(seq_ids), rollout_logprobs=t(lp),
                      loss_mask=t(mask), advantages=t(adv), weights=t(w), items=items, model_kwargs=model_kwargs,
                      real_tokens=sum(lengths))


def pack(items: list[TrainItem], max_tokens: int, *, device: Any = "cpu", rows: bool = True,
         attn_scale: float = DEFAULT_ATTN_SCALE) -> list[MicroBatch]:
    """Pack items into micro-batches of at most ``max_tokens`` tokens each (see the module docstring)."""
    alone = {i for i, it in enumerate(items) if it.multimodal}
    groups = plan_packs([it.num_tokens for it in items], max_tokens, alone=alone)
    return [build_micro_batch([items[i] for i in g], device=device, rows=rows, attn_scale=attn_scale)
            for g in groups]


def padding_fraction_padded(lengths: list[int], batch_size: int) -> float:
    """Share of compute that plain right-padded batches of ``batch_size`` would spend on padding (for reports)."""
    total = padded = 0
    for k in range(0, len(lengths), batch_size):
        chunk = lengths[k:k + batch_size]
        total += sum(chunk)
        padded += max(chunk) * len(chunk)
    return 0.0 if padded == 0 else 1.0 - total / padded


def response_logits(model: Any, mb: MicroBatch) -> Any:
    """Logits [T, V] that predict each response token of ``mb``."""
    if mb.input_ids.shape[0] == 1:  # one row: compute logits only where needed
        out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False,
                    logits_to_keep=mb.logit_index, **mb.model_kwargs)
        return out.logits[0]
    # several rows: all logits, then gather (rows are only used when that tensor is small)
    out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, **mb.model_kwargs)
    return out.logits.flatten(0, 1)[mb.logit_index]
