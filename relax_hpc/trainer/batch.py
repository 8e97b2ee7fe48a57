"""What the trainer consumes, and packing into micro-batches without padding.

A :class:`TrainItem` is one sample record (:class:`relax_hpc.record.Sample`, as the store reads it) plus what the
step computes for it: its advantage and weight. :func:`pack` groups items into
micro-batches of at most ``max_tokens`` tokens (first-fit decreasing), each laid out as ``R`` rows of ``W`` tokens
with position ids that restart at every sequence; HF models build a block-diagonal causal mask from the position ids
(no attention across sequences; SDPA models on the CPU get it ready-made, ``models/masks.py``). The tail of a row
that no sequence fills is padding (its own position run, never read); the row width is chosen per micro-batch by a
cost model of padding against attention (``padding_fraction`` is reported). One row (``R = 1``) has no padding at all
but attention over the whole row; several short rows cost far less attention on CPUs and small models.

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

from relax_hpc.record import Sample

DEFAULT_ATTN_SCALE = 6.0 * 64
"""``attn_scale`` of :func:`choose_row_width` for a model of hidden size 64 (the trainer passes 6 x its own)."""


@dataclass(eq=False, slots=True)
class TrainItem:
    """One sample as the trainer sees it: the record itself (not a copy) and its advantage."""

    sample: Sample
    """Prompt and response ids, rollout log-probs, loss mask (tool/environment tokens 0), reward, version, group,
    ``stale`` (older than the step's ``max_staleness`` bound but kept, ``store.stale_policy: flag``: the trainer clips
    its ratio around its own current log-probs and corrects by the truncated importance weight against the
    rollout's), multimodal tensors (such items get a micro-batch of their own unless packed by the model's 3-D
    positions)."""
    advantage: float = 0.0
    """Sequence advantage (filled by the algorithm before packing)."""
    weight: float = 1.0
    """Extra per-sample weight of the policy-gradient term."""
    token_advantages: np.ndarray | None = None
    """[R] per-token advantages (distillation); overrides ``advantage`` when set."""

    @classmethod
    def of(cls, prompt_ids: Any, response_ids: Any, *, logprobs: Any = None, loss_mask: Any = None,
           advantage: float = 0.0, weight: float = 1.0, token_advantages: np.ndarray | None = None,
           **sample_fields: Any) -> TrainItem:
        """An item built from arrays (the supervised warm-up, benchmarks, tests): log-probs 0 and the mask all ones
        unless given; ``sample_fields`` are the record's other fields (``reward``, ``group_id``, ``tensors`` ...)."""
        p, r = np.asarray(prompt_ids), np.asarray(response_ids)
        lp = np.zeros(len(r), np.float32) if logprobs is None else np.asarray(logprobs)
        mask = np.ones(len(r), np.uint8) if loss_mask is None else np.asarray(loss_mask)
        return cls(Sample(prompt_ids=p, response_ids=r, logprobs=lp, loss_mask=mask, **sample_fields),
                   advantage=advantage, weight=weight, token_advantages=token_advantages)

    @property
    def num_tokens(self) -> int:
        return len(self.sample.prompt_ids) + len(self.sample.response_ids)


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
    seq_starts: Any = None
    """[S] flat index (row * W + column) where each sequence begins (3-D positions of VL/Omni models)."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def plan_packs(lengths: list[int], max_tokens: int, *, alone: set[int] | None = None) -> list[list[int]]:
    """First-fit decreasing: indices grouped so each group's total length is <= max_tokens (a longer sequence gets a
    group of its own). Indices in ``alone`` always get a group of their own."""
    alone = alone or set()
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return _first_fit(order, lengths, max_tokens, alone)


def _first_fit(order: list[int], lengths: list[int], max_tokens: int, alone: set[int]) -> list[list[int]]:
    """First fit over ``order`` (longest first). A group with less room than the shortest item left can take
    nothing more: it leaves the list that is searched, so a search looks at the groups that are still open."""
    packs: list[list[int]] = []
    open_packs: list[int] = []  # indices into packs, in creation order
    room: list[int] = []
    shortest = min((lengths[i] for i in order if i not in alone), default=0)
    for i in order:
        n = lengths[i]
        if i in alone:
            packs.append([i])
            room.append(-1)
            continue
        for pos, k in enumerate(open_packs):
            if room[k] >= n:
                packs[k].append(i)
                room[k] -= n
                if room[k] < shortest:
                    del open_packs[pos]
                break
        else:
            packs.append([i])
            room.append(max_tokens - n)
            if room[-1] >= shortest:
                open_packs.append(len(packs) - 1)
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
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    best: tuple[float, int, list[list[int]]] | None = None
    for w in widths:  # ascending: no layout of width w costs less than total * (1 + w / attn_scale)
        if best is not None and total * (1.0 + w / attn_scale) >= best[0]:
            break
        rows = _first_fit(order, lengths, w, set())
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
    n = len(items)
    start = np.empty(n, dtype=np.int64)  # flat index (row * width + column) where each sequence begins
    fill = np.zeros(n_rows, dtype=np.int64)
    for r, members in enumerate(layout):
        col = 0
        for i in members:
            start[i] = r * width + col
            col += lengths[i]
        fill[r] = col
    samples = [it.sample for it in items]
    n_prompt = np.fromiter((len(s.prompt_ids) for s in samples), dtype=np.int64, count=n)
    n_resp = np.fromiter((len(s.response_ids) for s in samples), dtype=np.int64, count=n)
    seq_len = n_prompt + n_resp

    def within(counts: np.ndarray) -> np.ndarray:  # 0, 1, ... counts[s]-1 for each s, concatenated
        total = int(counts.sum())
        return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)

    tokens = np.concatenate([a for s in samples for a in (s.prompt_ids, s.response_ids)]).astype(np.int64)
    offset = within(seq_len)
    ids_t = np.zeros(n_rows * width, dtype=np.int64)
    ids_t[np.repeat(start, seq_len) + offset] = tokens
    # positions restart at every sequence; the unused tail of a row is its own run (never attended to by real tokens)
    cols = np.arange(width, dtype=np.int64)
    pos_t = np.where(cols[None, :] >= fill[:, None], cols[None, :] - fill[:, None], 0).reshape(-1)
    pos_t[np.repeat(start, seq_len) + offset] = offset
    j = within(n_resp)
    logit_index = np.repeat(start + n_prompt - 1, n_resp) + j
    targets = np.concatenate([s.response_ids for s in samples]).astype(np.int64)
    seq_ids = np.repeat(np.arange(n, dtype=np.int64), n_resp)
    lp = np.concatenate([s.logprobs for s in samples]).astype(np.float32)
    mask = np.concatenate([s.mask() for s in samples]).astype(np.float32)
    adv = np.repeat(np.asarray([it.advantage for it in items], dtype=np.float32), n_resp)
    if any(it.token_advantages is not None for it in items):
        first = np.cumsum(n_resp) - n_resp
        for s, it in enumerate(items):
            if it.token_advantages is not None:
                adv[first[s]:first[s] + n_resp[s]] = np.asarray(it.token_advantages, dtype=np.float32)
    w = np.repeat(np.asarray([it.weight for it in items], dtype=np.float32), n_resp)

    def t(a: np.ndarray) -> Any:
        return torch.from_numpy(a).to(device)

    model_kwargs: dict[str, Any] = {}
    if len(items) == 1 and samples[0].tensors:
        model_kwargs = {k: torch.as_tensor(v).to(device) for k, v in samples[0].model_inputs().items()}
    # -- omni-modal: VL/Omni models get per-sample 3-D positions and all samples' media from
    # -- relax_hpc.models.mrope.packed_inputs (in response_logits); seq_starts tells it where each sample sits.
    return MicroBatch(input_ids=t(ids_t.reshape(n_rows, width)), position_ids=t(pos_t.reshape(n_rows, width)),
                      logit_index=t(logit_index), targets=t(targets), seq_ids=t(seq_ids), rollout_logprobs=t(lp),
                      loss_mask=t(mask), advantages=t(adv), weights=t(w), items=items, model_kwargs=model_kwargs,
                      real_tokens=sum(lengths), seq_starts=start)


def pack(items: list[TrainItem], max_tokens: int, *, device: Any = "cpu", rows: bool = True,
         attn_scale: float = DEFAULT_ATTN_SCALE, pack_multimodal: bool = False) -> list[MicroBatch]:
    """Pack items into micro-batches of at most ``max_tokens`` tokens each (see the module docstring). Items with
    media get a micro-batch of their own unless ``pack_multimodal`` (VL/Omni models: their 3-D positions are
    computed per sample, see :mod:`relax_hpc.models.mrope`)."""
    alone = set() if pack_multimodal else {i for i, it in enumerate(items) if it.sample.tensors}
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
    # -- omni-modal (begin): 3-D positions, packed media and dummy encoder runs of VL/Omni models
    from relax_hpc.models.mrope import packed_inputs

    position_ids, kwargs = packed_inputs(model, mb)
    dummy = kwargs.pop("_encoder_dummy", None)
    input_ids = kwargs.pop("_input_ids", mb.input_ids)
    # -- omni-modal (end)
    kwargs = _with_packed_mask(model, position_ids, kwargs)
    if mb.input_ids.shape[0] == 1:  # one row: compute logits only where needed
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                    logits_to_keep=mb.logit_index, **kwargs)
        logits = out.logits[0]
        if logits.shape[0] != mb.logit_index.numel():  # omni-modal: Omni thinkers ignore logits_to_keep
            logits = logits[mb.logit_index]
    else:  # several rows: all logits, then gather (rows are only used when that tensor is small)
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        logits = out.logits.flatten(0, 1)[mb.logit_index]
    return logits if dummy is None else logits + dummy.to(logits.dtype)  # omni-modal: every encoder runs


def _with_packed_mask(model: Any, position_ids: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the rows' block-diagonal mask made here (``models/masks.py``) for a plain text SDPA model on
    the CPU, where the model's own mask building is a measurable part of a small model's step; elsewhere (GPUs,
    3-D positions, other attention kernels) the model builds it from the position ids."""
    from relax_hpc.models.masks import own_masks, packed_mask

    if "attention_mask" in kwargs or position_ids.dim() != 2 or position_ids.device.type != "cpu":
        return kwargs
    if not own_masks(model):
        return kwargs
    mask = packed_mask(position_ids)
    return kwargs if mask is None else {**kwargs, "attention_mask": mask}
