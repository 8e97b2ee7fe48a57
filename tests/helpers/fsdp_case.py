"""The FSDP2 case: one recipe and twelve train items, shared by the test and its rank processes."""

from __future__ import annotations

import numpy as np

from relax_hpc.trainer.batch import TrainItem

CFG = {"data": {"task": {"name": "reverse_digits"}}, "model": {"path": "tiny"},
       "trainer": {"lr": 1e-2, "micro_batch_tokens": 48, "device": "cpu", "num_ranks": 2},
       "rollout": {"sampling": {"max_new_tokens": 8}}}


def items() -> list[TrainItem]:
    rng = np.random.default_rng(3)
    out = []
    for i in range(12):
        p = rng.integers(4, 18, size=rng.integers(3, 7))
        r = rng.integers(4, 18, size=rng.integers(2, 8))
        out.append(TrainItem.of(prompt_ids=p, response_ids=r, logprobs=-np.abs(rng.normal(2.5, 0.3, len(r))),
                                loss_mask=np.ones(len(r)), advantage=float(rng.normal()), group_id=f"g{i // 4}"))
    return out
