"""Train/rollout mismatch metrics against an independent numpy computation, the trainer reporting them every step,
and the health alert on a jump."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from relax_hpc.algorithms.mismatch import MismatchMeter, bucket_of, mismatch_metrics
from relax_hpc.health import RunHealth


def _numpy_reference(trainer: np.ndarray, rollout: np.ndarray, mask: np.ndarray, cap: float) -> dict[str, float]:
    d = (trainer.astype(np.float64) - rollout.astype(np.float64))[mask > 0]
    ratio = np.exp(d)
    return {"kl": float(np.mean(ratio - 1.0 - d)), "abs_mean": float(np.mean(np.abs(d))),
            "abs_max": float(np.max(np.abs(d))), "big": float(np.mean(np.abs(d) > 0.5)),
            "clip": float(np.mean(ratio > cap))}


def _batch(rng: np.random.Generator, seqs: list[int]) -> tuple[np.ndarray, ...]:
    seq_ids = np.concatenate([np.full(n, i) for i, n in enumerate(seqs)])
    rollout = -rng.exponential(1.5, size=len(seq_ids)).astype(np.float32)
    trainer = (rollout + rng.normal(0, 0.6, size=len(seq_ids))).astype(np.float32)
    mask = (rng.random(len(seq_ids)) > 0.2).astype(np.float32)
    return trainer, rollout, mask, seq_ids


def test_metrics_equal_numpy_over_micro_batches() -> None:
    rng = np.random.default_rng(0)
    cap = 2.0
    meter = MismatchMeter(cap)
    parts = [_batch(rng, [5, 9, 3]), _batch(rng, [12, 7])]
    for trainer, rollout, mask, seq_ids in parts:
        meter.add(torch.from_numpy(trainer), torch.from_numpy(rollout), torch.from_numpy(mask),
                  torch.from_numpy(seq_ids), [0] * (int(seq_ids.max()) + 1))
    sums = meter.sums()
    got = mismatch_metrics(sums, meter.maxima())
    assert not [k for k in sums if k.startswith("mismatch_sum/")]  # popped
    ref = _numpy_reference(*(np.concatenate([p[i] for p in parts]) for i in range(3)), cap)
    assert got["train/mismatch_kl"] == pytest.approx(ref["kl"], rel=1e-6)
    assert got["train/logprob_abs_diff_mean"] == pytest.approx(ref["abs_mean"], rel=1e-6)
    assert got["train/logprob_abs_diff_max"] == pytest.approx(ref["abs_max"], rel=1e-6)
    assert got["train/logprob_diff_frac_gt_0.5"] == pytest.approx(ref["big"])
    assert got["train/mismatch_tis_clipfrac"] == pytest.approx(ref["clip"])
    assert 0 < ref["clip"] < ref["big"] < 1  # the random data exercises every counter
    assert not [k for k in got if "staleness" in k]  # one bucket (on-policy): no split


def test_split_by_staleness() -> None:
    rng = np.random.default_rng(1)
    trainer, rollout, mask, seq_ids = _batch(rng, [6, 4, 8, 5])
    staleness = [0, 1, 3, 0]
    meter = MismatchMeter(None)
    meter.add(torch.from_numpy(trainer), torch.from_numpy(rollout), torch.from_numpy(mask),
              torch.from_numpy(seq_ids), staleness)
    got = mismatch_metrics(meter.sums(), meter.maxima())
    for bucket, keep in (("0", {0, 3}), ("1", {1}), ("2plus", {2})):
        sel = np.isin(seq_ids, list(keep)).astype(np.float32) * mask
        ref = _numpy_reference(trainer, rollout, sel, math.inf)
        assert got[f"train/mismatch_kl/staleness_{bucket}"] == pytest.approx(ref["kl"], rel=1e-6)
        assert got[f"train/logprob_abs_diff_max/staleness_{bucket}"] == pytest.approx(ref["abs_max"], rel=1e-6)
        assert got[f"train/mismatch_tis_clipfrac/staleness_{bucket}"] == 0.0
    ref = _numpy_reference(trainer, rollout, mask, math.inf)
    assert got["train/mismatch_kl"] == pytest.approx(ref["kl"], rel=1e-6)
    assert [bucket_of(s) for s in (0, 1, 2, 7, -1)] == ["0", "1", "2plus", "2plus", "0"]


def test_identical_logprobs_give_zero() -> None:
    x = torch.tensor([-0.5, -2.0, -0.1])
    meter = MismatchMeter(2.0)
    meter.add(x, x.clone(), torch.ones(3), torch.zeros(3, dtype=torch.long), [0])
    got = mismatch_metrics(meter.sums(), meter.maxima())
    assert got["train/mismatch_kl"] == 0.0 and got["train/logprob_abs_diff_max"] == 0.0


class _Events:
    def __init__(self) -> None:
        self.alerts: list[tuple[str, str]] = []

    def alert(self, event: str, message: str, *, step: int | None = None, **fields: object) -> None:
        self.alerts.append((event, message))


def _health(events: _Events) -> RunHealth:
    from relax_hpc.config.schema import RecipeConfig

    return RunHealth(RecipeConfig.model_validate({"data": {"task": {"name": "reverse_digits"}}}), events)


def test_health_alerts_on_a_mismatch_jump_once() -> None:
    ev = _Events()
    h = _health(ev)
    for step, kl in enumerate([2e-7, 3e-7, 1e-7, 2e-7, 0.0, 5e-4]):  # float32 noise, then a bf16-sized wobble
        h.check({"train/mismatch_kl": kl}, step)
    assert ev.alerts == []
    h.check({"train/mismatch_kl": 0.02}, 6)  # the engine lost its weights
    h.check({"train/mismatch_kl": 0.03}, 7)
    assert [a[0] for a in ev.alerts] == ["mismatch_jump"]
    assert "train/mismatch_kl = 0.02 at step 6" in ev.alerts[0][1]


def test_health_judges_the_on_policy_part_and_a_high_start() -> None:
    ev = _Events()
    h = _health(ev)
    for step in range(4):  # stale samples carry a real policy change: not a jump
        h.check({"train/mismatch_kl": 0.05 * step, "train/mismatch_kl/staleness_0": 1e-7}, step)
    assert ev.alerts == []
    ev2 = _Events()
    h2 = _health(ev2)
    h2.check({"train/mismatch_kl": 0.5}, 1)  # broken from the first step: no history needed
    assert [a[0] for a in ev2.alerts] == ["mismatch_jump"]


def test_health_judges_stale_only_records_against_their_own_history() -> None:
    """fully_async at max_staleness 1: step 1 trains on v0 samples (no split, KL ~1e-13), every later step on samples
    one version stale, whose KL holds the policy's step (0.48 then falling, as the tiny demo on vLLM measured): no
    alert. A stale part that then jumps tenfold over its own history still alerts."""
    ev = _Events()
    h = _health(ev)
    h.check({"train/mismatch_kl": 6e-14}, 1)
    for step, kl in enumerate([0.476, 0.145, 0.104, 0.074, 0.032, 0.02, 0.03], 2):
        h.check({"train/mismatch_kl": kl, "train/mismatch_kl/staleness_1": kl}, step)
    assert ev.alerts == []
    h.check({"train/mismatch_kl": 0.9, "train/mismatch_kl/staleness_1": 0.9}, 9)
    assert [a[0] for a in ev.alerts] == ["mismatch_jump"]
    assert "train/mismatch_kl/staleness_1 = 0.9 at step 9" in ev.alerts[0][1]


def test_mismatch_part_prefers_the_least_stale_part() -> None:
    from relax_hpc.health import mismatch_part

    assert mismatch_part({"train/mismatch_kl": 1.0}) == ("train/mismatch_kl", True)
    assert mismatch_part({"train/mismatch_kl": 1.0, "train/mismatch_kl/staleness_2": 1.0,
                          "train/mismatch_kl/staleness_1": 1.0}) == ("train/mismatch_kl/staleness_1", False)
    assert mismatch_part({"train/mismatch_kl/staleness_0": 0.0, "train/mismatch_kl/staleness_1": 1.0}) == (
        "train/mismatch_kl/staleness_0", True)
    assert mismatch_part({"train/mismatch_kl": 1.0, "train/mismatch_kl/staleness_2plus": 1.0}) == (
        "train/mismatch_kl/staleness_2plus", False)
    assert mismatch_part({"train/loss": 1.0}) == (None, False)


def _recomputed(backend: object, items: list) -> None:
    """Set each item's rollout log-probs to the trainer's own (the same weights, as in colocate)."""
    from relax_hpc.trainer.batch import pack

    with torch.no_grad():
        for mb in pack(items, 1 << 20, device="cpu"):
            lp = backend.sequence_logprobs(backend.model, mb)[0]  # type: ignore[attr-defined]
            for i, it in enumerate(mb.items):
                it.sample.logprobs = lp[mb.seq_ids == i].numpy().astype(np.float32)


def test_trainer_reports_mismatch_every_step() -> None:
    """A real torch trainer step on the tiny model: rollout log-probs recomputed by the trainer itself (the same
    weights) give a mismatch at float32 rounding; shifted ones give exactly the shift."""
    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
    from relax_hpc.trainer.backend import make_backend
    from tests.helpers.backend_conformance import make_cfg, make_items

    cfg = make_cfg()
    tok = build_digits_tokenizer()
    model = build_tiny_model(cfg.model.tiny, len(tok), seed=0, pad_token_id=tok.pad_token_id,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    backend = make_backend(cfg, rank=0, world_size=1, device="cpu", dtype=torch.float32,
                           algorithm=get_algorithm(cfg.algorithm.name), tokenizer=tok, model=model)
    items = make_items(8)
    _recomputed(backend, items)
    m = backend.train_step(items)
    assert m["train/mismatch_kl"] < 1e-9 and m["train/logprob_abs_diff_max"] < 1e-4
    _recomputed(backend, items)
    for it in items:
        it.sample.logprobs = it.sample.logprobs - np.float32(0.6)  # the engine "sampled" from other weights
    m = backend.train_step(items)
    assert m["train/logprob_abs_diff_mean"] == pytest.approx(0.6, abs=1e-3)
    assert m["train/logprob_diff_frac_gt_0.5"] == 1.0
    assert m["train/mismatch_kl"] == pytest.approx(math.exp(0.6) - 1 - 0.6, rel=1e-3)
    assert m["train/mismatch_tis_clipfrac"] == 0.0  # exp(0.6) < tis_cap 2.0
    for it in items:
        it.sample.version = -3  # three versions older than the trainer's weights (step 2): split by staleness
    _recomputed(backend, items)
    m = backend.train_step(items)
    assert m["train/mismatch_kl/staleness_2plus"] == m["train/mismatch_kl"] < 1e-9
