"""Off-policy correction in the trainer: a stale batch (rollout log-probs from another policy) gets truncated
importance weights min(pi_prox / pi_rollout, cap), with the proximal policy recomputed by the trainer itself."""

from __future__ import annotations

import copy

import numpy as np
import torch

from relax_hpc.algorithms.registry import get_algorithm
from relax_hpc.config.load import validate_dict
from relax_hpc.models.tiny import build_tiny_model
from relax_hpc.trainer.batch import TrainItem
from relax_hpc.trainer.torch_trainer import TorchTrainer


def _cfg(**algo):
    return validate_dict({"data": {"task": {"name": "reverse_digits"}}, "model": {"path": "tiny"},
                          "trainer": {"lr": 1e-3, "micro_batch_tokens": 64, "device": "cpu"},
                          "algorithm": {"tis_cap": 2.0, **algo}})


def _current_logprobs(model, it: TrainItem) -> np.ndarray:
    ids = torch.tensor(np.concatenate([it.sample.prompt_ids, it.sample.response_ids]))[None]
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
    p = len(it.sample.prompt_ids)
    return lp[p - 1:-1].gather(-1, torch.tensor(it.sample.response_ids)[:, None])[:, 0].numpy()


def test_stale_batch_gets_truncated_importance_weights() -> None:
    cfg = _cfg(proximal=True)
    model = build_tiny_model(cfg.model.tiny, 18, seed=0)
    rng = np.random.default_rng(0)
    items, cur, stale = [], [], []
    for i in range(8):
        it = TrainItem.of(prompt_ids=rng.integers(4, 18, 5), response_ids=rng.integers(4, 18, rng.integers(2, 7)),
                       logprobs=np.zeros(1), loss_mask=np.ones(1), advantage=float(rng.normal()),
                       group_id=str(i // 4))
        c = _current_logprobs(model, it)
        shift = rng.normal(0.0, 1.0, len(c)).astype(np.float32)  # the stale policy differs per token
        it.sample.logprobs = (c - shift).astype(np.float32)
        it.sample.loss_mask = np.ones(len(c))
        items.append(it)
        cur.append(c)
        stale.append(it.sample.logprobs)
    ratio = np.exp(np.concatenate(cur) - np.concatenate(stale))
    want_mean = np.minimum(ratio, 2.0).mean()
    want_clip = (ratio > 2.0).mean()
    tr = TorchTrainer(cfg, model, device="cpu", dtype=torch.float32, algorithm=get_algorithm("grpo"))
    m = tr.train_step(copy.deepcopy(items))
    assert abs(m["train/tis_weight_mean"] - want_mean) < 1e-4, (m["train/tis_weight_mean"], want_mean)
    assert abs(m["train/tis_clipfrac"] - want_clip) < 1e-6
    assert 0 < want_clip < 1  # the batch really had weights on both sides of the cap


def test_on_policy_batch_has_unit_weights() -> None:
    cfg = _cfg(proximal=True)
    model = build_tiny_model(cfg.model.tiny, 18, seed=1)
    rng = np.random.default_rng(1)
    items = []
    for _ in range(4):
        it = TrainItem.of(prompt_ids=rng.integers(4, 18, 4), response_ids=rng.integers(4, 18, 3),
                       logprobs=np.zeros(3), loss_mask=np.ones(3), advantage=1.0, group_id="g")
        it.sample.logprobs = _current_logprobs(model, it)
        items.append(it)
    m = TorchTrainer(cfg, model, device="cpu", dtype=torch.float32, algorithm=get_algorithm("grpo")).train_step(items)
    assert abs(m["train/tis_weight_mean"] - 1.0) < 1e-4
    assert m["train/tis_clipfrac"] == 0.0
