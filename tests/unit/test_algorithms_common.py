"""Shared algorithm helpers against hand-worked values: advantages, DAPO shaping, aggregation, KL, TIS."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from relax_hpc.algorithms.base import TIS_CLIPFRAC, TIS_WEIGHT_MEAN, LossInputs
from relax_hpc.algorithms.common import (
    aggregate,
    count_normalisers,
    dynamic_sampling_mask,
    group_advantages,
    kl_penalty,
    overlong_penalty,
    step_advantages,
    tis_weights,
    token_tis,
)
from relax_hpc.algorithms.grpo import ALGORITHM as GRPO
from relax_hpc.algorithms.sapo import soft_gate
from relax_hpc.config.schema import GRPOConfig, OverlongConfig

# Four groups with non-contiguous, interleaved labels: 7 -> [1, 0, 1, 0], 3 -> [0.1] * 3, 9 -> [5] (alone),
# 1 -> [0, 1, 0, 0].
REWARDS = np.array([1, 0.1, 0, 0, 1, 0.1, 1, 5, 0, 0.1, 0, 0], dtype=np.float64)
GROUPS = np.array([7, 3, 7, 1, 7, 3, 1, 9, 7, 3, 1, 1])


def test_group_advantages_grpo_by_hand() -> None:
    adv = group_advantages(REWARDS, GROUPS, std_normalize=True)
    s = 0.5 / (0.5 + 1e-6)  # group 7: mean 0.5, population std 0.5
    r3 = math.sqrt(3.0)  # group 1: mean 0.25, population std sqrt(0.1875); (1 - 0.25) / that = sqrt(3)
    expected = [s, 0, -s, -1 / r3, s, 0, r3, 0, -s, 0, -1 / r3, -1 / r3]
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-6)
    # zero-variance group and single-sample group give exactly 0 (no 1e-17 / eps blow-up)
    assert np.all(adv[[1, 5, 7, 9]] == 0.0)


def test_group_advantages_dr_grpo_by_hand() -> None:
    adv = group_advantages(REWARDS, GROUPS, std_normalize=False)
    expected = [0.5, 0, -0.5, -0.25, 0.5, 0, 0.75, 0, -0.5, 0, -0.25, -0.25]
    np.testing.assert_allclose(adv, expected, rtol=1e-6, atol=1e-7)
    assert np.all(adv[[1, 5, 7, 9]] == 0.0)


def test_group_advantages_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        group_advantages(np.zeros(3), np.zeros(2), std_normalize=True)
    with pytest.raises(ValueError, match="finite"):
        group_advantages(np.array([1.0, np.nan]), np.zeros(2), std_normalize=True)
    assert group_advantages(np.zeros(0), np.zeros(0), std_normalize=True).shape == (0,)


def test_dynamic_sampling_mask() -> None:
    keep = dynamic_sampling_mask(REWARDS, GROUPS)
    expected = [g in (7, 1) for g in GROUPS]  # group 3 (all 0.1) and 9 (single sample) carry no signal
    assert keep.dtype == bool
    assert keep.tolist() == expected


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (79, 0.0), (80, 0.0), (81, -0.1), (85, -0.5), (89, -0.9), (90, -1.0), (120, -1.0)],
)
def test_overlong_penalty_boundaries(length: int, expected: float) -> None:
    # max 90, buffer 10, penalty 1: free up to 80, linear to -1 at 90, -1 beyond
    out = overlong_penalty(np.array([length]), max_new_tokens=90, buffer_tokens=10, penalty=1.0)
    assert out.shape == (1,)
    assert out[0] == pytest.approx(expected, abs=1e-7)


def test_overlong_penalty_scales_and_validates() -> None:
    out = overlong_penalty(np.array([4, 6, 8]), max_new_tokens=8, buffer_tokens=4, penalty=0.5)
    np.testing.assert_allclose(out, [0.0, -0.25, -0.5])
    with pytest.raises(ValueError, match="buffer_tokens"):
        overlong_penalty(np.array([1]), max_new_tokens=8, buffer_tokens=0, penalty=1.0)


def test_step_advantages_applies_overlong_then_dynamic_sampling() -> None:
    # group a: equal rewards, but the second response is in the overlong zone -> rewards [1, 0.5]: kept
    # group b: equal rewards, both short -> dropped (and advantage 0)
    rewards = np.array([1.0, 1.0, 0.0, 0.0])
    groups = np.array([0, 0, 1, 1])
    lengths = np.array([10, 95, 3, 4])
    cfg = GRPOConfig(dynamic_sampling=True, overlong=OverlongConfig(enabled=True, buffer_tokens=10, penalty=1.0))
    adv, keep = step_advantages(GRPO, rewards, groups, lengths, cfg=cfg, max_new_tokens=100)
    assert keep.tolist() == [True, True, False, False]
    s = 0.25 / (0.25 + 1e-6)
    np.testing.assert_allclose(adv, [s, -s, 0.0, 0.0], rtol=1e-6)
    # without the options: nothing dropped, no penalty -> all advantages 0
    adv, keep = step_advantages(GRPO, rewards, groups, lengths, cfg=GRPOConfig(), max_new_tokens=100)
    assert keep.all()
    assert np.all(adv == 0.0)


def _inputs(values: torch.Tensor, seq_ids: list[int], mask: list[float], **kw: float) -> LossInputs:
    t = values.shape[0]
    return LossInputs(
        logprobs=values,
        old_logprobs=torch.zeros(t, dtype=values.dtype),
        rollout_logprobs=torch.zeros(t, dtype=values.dtype),
        advantages=torch.zeros(t, dtype=values.dtype),
        loss_mask=torch.tensor(mask, dtype=values.dtype),
        seq_ids=torch.tensor(seq_ids),
        num_seqs=max(seq_ids) + 1,
        global_num_tokens=kw.get("tokens", 5.0),
        global_num_seqs=kw.get("seqs", 2.0),
        max_response_tokens=int(kw.get("max_tokens", 4)),
    )


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", 19 / 5),
        ("seq_mean_token_mean", (1.5 + 16 / 3) / 2),
        ("seq_mean_token_sum", 19 / 2),
        ("seq_mean_token_sum_norm", 19 / 4 / 2),
    ],
)
def test_aggregate_by_hand(mode: str, expected: float) -> None:
    # seq 0: [1, 2]; seq 1: [3, 4, 9] and a masked-out NaN that must not leak
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 9.0, math.nan], dtype=torch.float64, requires_grad=True)
    x = _inputs(values, [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0])
    out = aggregate(values, x, mode)
    assert out.item() == pytest.approx(expected, rel=1e-12)
    out.backward()
    assert values.grad is not None
    assert values.grad[5].item() == 0.0
    assert torch.all(values.grad[:5] > 0)


def test_aggregate_global_normaliser_and_unknown_mode() -> None:
    values = torch.tensor([2.0, 4.0], dtype=torch.float64)
    x = _inputs(values, [0, 0], [1, 1], tokens=8.0, seqs=4.0)  # the rest of the step lives elsewhere
    assert aggregate(values, x, "token_mean").item() == pytest.approx(6 / 8)
    assert aggregate(values, x, "seq_mean_token_mean").item() == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="token_mean, seq_mean_token_mean"):
        aggregate(values, x, "sum")


def test_count_normalisers() -> None:
    mask = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    seq_ids = torch.tensor([0, 1, 1, 2, 3, 3])
    assert count_normalisers(mask, seq_ids, 5) == (3.0, 2.0)  # seqs 1, 2 (all masked) and 4 (empty) not counted


def test_kl_estimators_by_hand() -> None:
    ln2 = math.log(2.0)
    logp = torch.tensor([math.log(0.5), math.log(0.25), -1.0], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25), math.log(0.5), -1.0], dtype=torch.float64)  # log r = -ln2, +ln2, 0
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([ln2, -ln2, 0.0], dtype=torch.float64))
    k2 = 0.5 * ln2**2
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([k2, k2, 0.0], dtype=torch.float64))
    k3 = torch.tensor([0.5 - 1 + ln2, 2 - 1 - ln2, 0.0], dtype=torch.float64)
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), k3)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


def test_kl_gradient_sign() -> None:
    # k3's gradient wrt logp is 1 - r: pushes logp down where pi > pi_ref (r < 1)
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    kl_penalty(logp, ref, "k3").sum().backward()
    assert logp.grad is not None
    assert logp.grad.item() == pytest.approx(0.5)


def test_tis_weights_capping() -> None:
    old = torch.tensor([0.0, math.log(1.5), math.log(3.0), -math.log(2.0)], requires_grad=True)
    rollout = torch.zeros(4)
    w = tis_weights(old, rollout, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([1.0, 1.5, 2.0, 0.5]))
    assert not w.requires_grad
    torch.testing.assert_close(tis_weights(old, rollout, cap=None), torch.ones(4))
    with pytest.raises(ValueError, match="tis_cap"):
        tis_weights(old, rollout, cap=0.0)


def test_token_tis_metrics() -> None:
    x = _inputs(torch.zeros(4), [0, 0, 1, 1], [1, 1, 1, 0], tokens=3.0)
    x.old_logprobs = torch.tensor([math.log(3.0), 0.0, math.log(0.5), math.log(10.0)])
    w, metrics = token_tis(x, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([2.0, 1.0, 0.5, 2.0]))
    assert metrics[TIS_WEIGHT_MEAN].item() == pytest.approx((2.0 + 1.0 + 0.5) / 3)
    assert metrics[TIS_CLIPFRAC].item() == pytest.approx(1 / 3)  # the 4th token is truncated but masked out


def test_sapo_gate_derivative_is_one_at_r1_and_decays() -> None:
    def slope(r: float, adv: float, tau_pos: float = 1.0, tau_neg: float = 1.05) -> float:
        ratio = torch.tensor([r], dtype=torch.float64, requires_grad=True)
        soft_gate(ratio, torch.tensor([adv], dtype=torch.float64), tau_pos, tau_neg).sum().backward()
        assert ratio.grad is not None
        return ratio.grad.item()

    def by_hand(r: float, tau: float) -> float:
        p = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
        return 4.0 * p * (1.0 - p)

    assert slope(1.0, 1.0) == pytest.approx(1.0)
    assert slope(1.0, -1.0) == pytest.approx(1.0)
    assert slope(2.0, 1.0) == pytest.approx(by_hand(2.0, 1.0)) == pytest.approx(0.786448, rel=1e-5)
    assert slope(0.5, -1.0) == pytest.approx(by_hand(0.5, 1.05))
    pos = [slope(r, 1.0) for r in (1.0, 1.5, 2.0, 3.0, 5.0)]
    assert all(a > b for a, b in itertools.pairwise(pos))
    assert pos[-1] < 0.1
    # a larger temperature decays faster
    assert slope(3.0, 1.0, tau_pos=4.0) < slope(3.0, 1.0, tau_pos=1.0)
    # value at r = 1 is 2 / tau
    gate = soft_gate(torch.ones(2), torch.tensor([1.0, -1.0]), 1.0, 2.0)
    torch.testing.assert_close(gate, torch.tensor([2.0, 1.0]))


def test_loss_inputs_validates_shapes() -> None:
    with pytest.raises(ValueError, match="advantages has shape"):
        LossInputs(
            logprobs=torch.zeros(3),
            old_logprobs=torch.zeros(3),
            rollout_logprobs=torch.zeros(3),
            advantages=torch.zeros(2),
            loss_mask=torch.ones(3),
            seq_ids=torch.zeros(3, dtype=torch.long),
            num_seqs=1,
            global_num_tokens=3,
            global_num_seqs=1,
            max_response_tokens=3,
        )
    with pytest.raises(ValueError, match=r"torch\.long"):
        LossInputs(
            logprobs=torch.zeros(3),
            old_logprobs=torch.zeros(3),
            rollout_logprobs=torch.zeros(3),
            advantages=torch.zeros(3),
            loss_mask=torch.ones(3),
            seq_ids=torch.zeros(3),
            num_seqs=1,
            global_num_tokens=3,
            global_num_seqs=1,
            max_response_tokens=3,
        )
