"""Store samples -> trainer items (the trainer never sees the store's classes)."""

from __future__ import annotations

from typing import Any

import numpy as np

from relax_hpc.trainer.batch import TrainItem


def samples_to_items(samples: list[Any]) -> list[TrainItem]:
    """One :class:`TrainItem` per store sample, in order; a sample read with ``stale`` set (``stale_policy: flag``)
    gives a stale item, which the trainer re-weights by importance sampling."""
    from relax_hpc.store.sample import to_torch

    nd = np.ndarray
    items: list[TrainItem] = []
    for s in samples:
        p, r, lp, m = s.prompt_ids, s.response_ids, s.logprobs, s.loss_mask
        if m is None:
            m = np.ones(len(r), dtype=np.uint8)
        mm = {k: to_torch(v, s.tensor_dtypes.get(k)) for k, v in s.tensors.items()} if s.tensors else {}
        items.append(TrainItem(prompt_ids=p if type(p) is nd else np.asarray(p),
                               response_ids=r if type(r) is nd else np.asarray(r),
                               rollout_logprobs=lp if type(lp) is nd else np.asarray(lp),
                               loss_mask=m if type(m) is nd else np.asarray(m),
                               reward=float(s.reward), version=int(s.version), group_id=s.group_id,
                               stale=bool(getattr(s, "stale", False)), multimodal=mm,
                               turns=getattr(s, "turns", None)))
    return items
