"""Every algorithm x every loss_agg against an independent float64 loop reference, on a small ragged batch.

The batch: 5 sequences of lengths 1, 3, 5, 2, 4; a masked-out (tool) token in sequence 2; sequence 4 fully masked
(a dropped sample, with wild log-probs that must not leak); ratios clipped above and below; TIS weights above the cap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import Tensor

from relax_hpc.algorithms.base import (
    ENTROPY_LOSS,
    KL_LOSS,
    PG_CLIPFRAC,
    PG_LOSS,
    PPO_KL,
    TIS_CLIPFRAC,
    TIS_WEIGHT_MEAN,
    LossInputs,
    concat_inputs,
)
from relax_hpc.algorithms.registry import get_algorithm
from relax_hpc.config.schema import AlgorithmConfig, DistillConfig, algorithm_config

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
ALGOS = ["grpo", "gspo", "sapo", "distill"]
F64 = torch.float64

SEQ_LENS = [1, 3, 5, 2, 4]
SEQ_ADV = [1.0, -0.5, 0.8, -1.2, 0.3]
LOGP = [-0.3, -1.1, -0.7, -2.0, -0.05, -1.6, -0.9, -0.4, -1.3, -0.8, -2.2, -0.6, -1.0, -0.2, -1.5]
DELTA = [0.4, -0.5, 0.1, 0.5, -0.4, 0.0, 0.25, 0.3, -0.1, 0.05, -0.35, 2.0, -3.0, 0.1, 0.0]  # logp - old
MASK = [1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0]
OLD_MINUS_ROLLOUT = [0.8, 0.9, -0.2, 0.1, 0.0, 0.8, -0.5, 0.0, 0.3, 0.0, 0.75, 0.0, 0.1, 0.0, 0.0]
REF_MINUS_LOGP = [0.1, -0.2, 0.3, 0.0, 0.5, -0.4, 0.2, 0.1, -0.1, 0.6, -0.3, 0.2, 0.0, 0.1, -0.2]
TEACHER_MINUS_OLD = [-0.2, 0.4, -1.0, 0.3, 0.0, 0.7, -0.5, 0.2, 0.1, -0.3, 0.9, 0.0, 0.4, -0.6, 0.2]
ENTROPY = [0.5, 1.2, 0.8, 2.0, 0.1, 1.5, 0.9, 0.3, 0.7, 1.1, 0.4, 0.6, 1.0, 0.2, 0.8]
SAMPLE_W = [1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0]
NUM_TOKENS, NUM_SEQS, MAX_TOKENS = 10.0, 4.0, 6  # masked-in tokens; sequences with any; Dr.GRPO constant
STARTS = [sum(SEQ_LENS[:i]) for i in range(len(SEQ_LENS))]


def make_cfg(algo: str, mode: str, **kw: object) -> AlgorithmConfig:
    base: dict[str, object] = dict(
        name=algo,
        loss_agg=mode,
        kl_coef=0.05,
        kl_type="k3",
        entropy_coef=0.01,
        tis_cap=2.0,
    )
    if algo == "distill":  # the distill section exists only for distill
        base.update(distill=DistillConfig(coef=0.5))
    if algo == "gspo":
        base.update(clip_low=0.1, clip_high=0.1)  # sequence ratios here lie in 0.86 .. 1.49
    base.update(kw)
    return algorithm_config(**base)


@dataclass
class Leaves:
    """The differentiable inputs, shared by the module and the reference."""

    logp: Tensor
    entropy: Tensor


def leaves() -> Leaves:
    return Leaves(
        torch.tensor(LOGP, dtype=F64, requires_grad=True), torch.tensor(ENTROPY, dtype=F64, requires_grad=True)
    )


def make_inputs(lv: Leaves, seqs: list[int], *, sample_weights: bool = True, old_is_logp: bool = False) -> LossInputs:
    """A micro-batch of the sequences ``seqs`` (contiguous token ranges), on the whole batch's normalisers."""
    idx = [t for s in seqs for t in range(STARTS[s], STARTS[s] + SEQ_LENS[s])]
    ix = torch.tensor(idx)
    logp = torch.tensor(LOGP, dtype=F64)
    old = logp if old_is_logp else logp - torch.tensor(DELTA, dtype=F64)
    adv = torch.tensor([SEQ_ADV[s] for s in range(len(SEQ_LENS)) for _ in range(SEQ_LENS[s])], dtype=F64)
    return LossInputs(
        logprobs=lv.logp[ix],
        old_logprobs=old[ix],
        rollout_logprobs=(old - torch.tensor(OLD_MINUS_ROLLOUT, dtype=F64))[ix],
        advantages=adv[ix],
        loss_mask=torch.tensor(MASK, dtype=F64)[ix],
        seq_ids=torch.tensor([i for i, s in enumerate(seqs) for _ in range(SEQ_LENS[s])]),
        num_seqs=len(seqs),
        global_num_tokens=NUM_TOKENS,
        global_num_seqs=NUM_SEQS,
        max_response_tokens=MAX_TOKENS,
        entropy=lv.entropy[ix],
        ref_logprobs=(logp + torch.tensor(REF_MINUS_LOGP, dtype=F64))[ix],
        teacher_logprobs=(old + torch.tensor(TEACHER_MINUS_OLD, dtype=F64))[ix],
        sample_weights=torch.tensor(SAMPLE_W, dtype=F64)[ix] if sample_weights else None,
    )


# ------------------------------------------------------------------------------------------ the loop reference
def ref_agg(per_seq: list[list[Tensor]], mode: str) -> Tensor:
    zero = torch.zeros((), dtype=F64)
    if mode == "token_mean":
        return sum((v for seq in per_seq for v in seq), zero) / NUM_TOKENS
    if mode == "seq_mean_token_mean":
        return sum((sum(seq, zero) / len(seq) for seq in per_seq if seq), zero) / NUM_SEQS
    if mode == "seq_mean_token_sum":
        return sum((sum(seq, zero) for seq in per_seq), zero) / NUM_SEQS
    assert mode == "seq_mean_token_sum_norm"
    return sum((sum(seq, zero) / MAX_TOKENS for seq in per_seq), zero) / NUM_SEQS


def reference(
    algo: str, cfg: AlgorithmConfig, lv: Leaves, *, sample_weights: bool = True, old_is_logp: bool = False
) -> tuple[Tensor, dict[str, float]]:
    """Per sequence, per token, scalar float64 arithmetic; no code shared with the package."""
    pg: list[list[Tensor]] = []
    kl: list[list[Tensor]] = []
    ent: list[list[Tensor]] = []
    n_clipped = n_trunc = w_sum = ppo_kl = 0.0
    for s, (start, n) in enumerate(zip(STARTS, SEQ_LENS, strict=True)):
        toks = [t for t in range(start, start + n) if MASK[t]]
        old = {t: LOGP[t] - (0.0 if old_is_logp else DELTA[t]) for t in toks}
        if algo == "gspo" and toks:
            log_s = sum(lv.logp[t] - old[t] for t in toks) / len(toks)
            log_w_seq = sum(OLD_MINUS_ROLLOUT[t] for t in toks) / len(toks)
        pg.append([])
        kl.append([])
        ent.append([])
        for t in toks:
            lp = lv.logp[t]
            if algo == "gspo":
                ratio = torch.exp(log_s.detach() + lp - lp.detach())
                log_w = log_w_seq
            else:
                ratio = torch.exp(lp - old[t])
                log_w = OLD_MINUS_ROLLOUT[t]
            w = min(math.exp(log_w), cfg.tis_cap)
            n_trunc += math.exp(log_w) > cfg.tis_cap
            w_sum += w
            adv = SEQ_ADV[s]
            if algo == "distill":
                adv = adv - cfg.distill.coef * (-TEACHER_MINUS_OLD[t])
            if algo == "sapo":
                tau = cfg.sapo_tau_pos if adv > 0 else cfg.sapo_tau_neg
                gate = (4.0 / tau) / (1.0 + torch.exp(-tau * (ratio - 1.0)))
                p = 1.0 / (1.0 + math.exp(-tau * (ratio.item() - 1.0)))
                n_clipped += 4 * p * (1 - p) < 0.5
                term = -gate * adv
            else:
                lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
                r = ratio.item()
                rc = lo if r < lo else (hi if r > hi else ratio)
                if r * adv <= (rc if isinstance(rc, float) else r) * adv:
                    term = -(ratio * adv)
                else:
                    term = -(rc * adv)
                    n_clipped += 1
                term = term if isinstance(term, Tensor) else torch.tensor(term, dtype=F64)
            if sample_weights:
                term = term * SAMPLE_W[t]
            pg[-1].append(term * w)
            log_r = LOGP[t] + REF_MINUS_LOGP[t] - lp
            kl[-1].append(torch.exp(log_r) - 1.0 - log_r)
            ent[-1].append(lv.entropy[t])
            ppo_kl += old[t] - LOGP[t]
    loss = (
        ref_agg(pg, cfg.loss_agg)
        + cfg.kl_coef * ref_agg(kl, cfg.loss_agg)
        - cfg.entropy_coef * ref_agg(ent, cfg.loss_agg)
    )
    metrics = {
        PG_LOSS: ref_agg(pg, cfg.loss_agg).item(),
        KL_LOSS: ref_agg(kl, cfg.loss_agg).item(),
        ENTROPY_LOSS: ref_agg(ent, cfg.loss_agg).item(),
        PG_CLIPFRAC: n_clipped / NUM_TOKENS,
        PPO_KL: ppo_kl / NUM_TOKENS,
        TIS_WEIGHT_MEAN: w_sum / NUM_TOKENS,
        TIS_CLIPFRAC: n_trunc / NUM_TOKENS,
    }
    return loss, metrics


def grads(loss: Tensor, lv: Leaves) -> tuple[Tensor, Tensor]:
    g_logp, g_ent = torch.autograd.grad(loss, [lv.logp, lv.entropy])
    return g_logp, g_ent


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", ALGOS)
def test_loss_metrics_and_grads_match_reference(algo: str, mode: str) -> None:
    cfg = make_cfg(algo, mode)
    lv = leaves()
    loss, metrics = get_algorithm(algo).loss(make_inputs(lv, [0, 1, 2, 3, 4]), cfg)
    ref_loss, ref_metrics = reference(algo, cfg, lv)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-10, abs=1e-12)
    for key, value in ref_metrics.items():
        assert not metrics[key].requires_grad
        assert metrics[key].item() == pytest.approx(value, rel=1e-10, abs=1e-12), key
    # the loss is exactly its reported parts
    parts = metrics[PG_LOSS] + cfg.kl_coef * metrics[KL_LOSS] - cfg.entropy_coef * metrics[ENTROPY_LOSS]
    assert loss.item() == pytest.approx(parts.item(), rel=1e-12)

    g_logp, g_ent = grads(loss, lv)
    r_logp, r_ent = grads(ref_loss, lv)
    torch.testing.assert_close(g_logp, r_logp, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(g_ent, r_ent, rtol=1e-9, atol=1e-12)
    masked_out = torch.tensor(MASK) == 0
    assert torch.all(g_logp[masked_out] == 0) and torch.all(g_ent[masked_out] == 0)
    assert torch.all(g_ent[~masked_out] < 0)  # the entropy bonus lowers the loss on every masked-in token


def test_fixture_clips_on_both_sides() -> None:
    lv = leaves()
    for algo in ("grpo", "gspo"):
        _, m = reference(algo, make_cfg(algo, "token_mean"), lv)
        assert m[PG_CLIPFRAC] > 0 and m[TIS_CLIPFRAC] > 0
    # GRPO: clipped above (A > 0, r > 1.28) at tokens 0 and 7, below (A < 0, r < 0.8) at tokens 1 and 10
    cfg = make_cfg("grpo", "token_mean", kl_coef=0.0, entropy_coef=0.0)
    lv = leaves()
    loss, _ = get_algorithm("grpo").loss(make_inputs(lv, [0, 1, 2, 3, 4]), cfg)
    (g,) = torch.autograd.grad(loss, [lv.logp])
    zero = {0, 1, 7, 10} | {t for t, m in enumerate(MASK) if not m}
    for t in range(len(LOGP)):
        assert (g[t].item() == 0.0) == (t in zero), t


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", ALGOS)
def test_two_micro_batches_sum_to_one_batch(algo: str, mode: str) -> None:
    cfg = make_cfg(algo, mode)
    lv_full, lv_split = leaves(), leaves()
    algorithm = get_algorithm(algo)
    full, full_m = algorithm.loss(make_inputs(lv_full, [0, 1, 2, 3, 4]), cfg)
    (a, a_m), (b, b_m) = (algorithm.loss(make_inputs(lv_split, seqs), cfg) for seqs in ([2, 0], [4, 1, 3]))
    assert (a + b).item() == pytest.approx(full.item(), rel=1e-12)
    for key, value in full_m.items():
        assert (a_m[key] + b_m[key]).item() == pytest.approx(value.item(), rel=1e-10, abs=1e-14), key
    torch.testing.assert_close(grads(a + b, lv_split), grads(full, lv_full), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", ALGOS)
def test_one_call_over_concatenated_micro_batches_equals_their_sum(algo: str, mode: str) -> None:
    """The trainer computes a step's metrics with one loss call over ``concat_inputs`` of its micro-batches."""
    cfg = make_cfg(algo, mode)
    lv = leaves()
    algorithm = get_algorithm(algo)
    parts = [make_inputs(lv, seqs) for seqs in ([2, 0], [4], [1, 3])]
    parts[1].sample_weights = None  # missing weights count as 1
    joined = concat_inputs(parts)
    assert joined.num_seqs == 5 and joined.seq_ids.tolist() == [0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4]
    total, total_m = algorithm.loss(joined, cfg)
    losses = [algorithm.loss(x, cfg) for x in parts]
    assert total.item() == pytest.approx(sum(v.item() for v, _ in losses), rel=1e-12)
    for key, value in total_m.items():
        assert value.item() == pytest.approx(sum(m[key].item() for _, m in losses), rel=1e-10, abs=1e-14), key
    assert concat_inputs(parts[:1]) is parts[0]
    parts[2].ref_logprobs = None
    with pytest.raises(ValueError, match="ref_logprobs is set in some micro-batches only"):
        concat_inputs(parts)


def test_gspo_matches_direct_sequence_level_objective() -> None:
    """With seq_mean_token_mean and a per-sequence advantage, GSPO-token == the sequence form, value and gradient."""
    cfg = make_cfg("gspo", "seq_mean_token_mean", kl_coef=0.0, entropy_coef=0.0)
    lv_mod, lv_dir = leaves(), leaves()
    loss, _ = get_algorithm("gspo").loss(make_inputs(lv_mod, [0, 1, 2, 3, 4], sample_weights=False), cfg)

    direct = torch.zeros((), dtype=F64)
    clipped = []
    for s, (start, n) in enumerate(zip(STARTS, SEQ_LENS, strict=True)):
        toks = torch.tensor([t for t in range(start, start + n) if MASK[t]], dtype=torch.long)
        if len(toks) == 0:
            continue
        old = torch.tensor(LOGP, dtype=F64)[toks] - torch.tensor(DELTA, dtype=F64)[toks]
        seq_ratio = torch.exp((lv_dir.logp[toks] - old).mean())  # s_i, differentiated as a whole
        w = min(math.exp(sum(OLD_MINUS_ROLLOUT[t] for t in toks.tolist()) / len(toks)), cfg.tis_cap)
        a = SEQ_ADV[s]
        obj = torch.minimum(seq_ratio * a, seq_ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * a)
        clipped.append(bool(obj.item() < (seq_ratio * a).item()))
        direct = direct - obj * w
    direct = direct / NUM_SEQS
    assert clipped == [True, False, False, True]  # sequence 0 above the range (A > 0), sequence 3 below (A < 0)
    assert loss.item() == pytest.approx(direct.item(), rel=1e-12)
    (g_mod,) = torch.autograd.grad(loss, [lv_mod.logp])
    (g_dir,) = torch.autograd.grad(direct, [lv_dir.logp])
    torch.testing.assert_close(g_mod, g_dir, rtol=1e-10, atol=1e-14)
    assert torch.all(g_mod[[0, 9, 10]] == 0)  # clipped sequences send no gradient
    assert torch.all(g_mod[[1, 2, 3, 4, 5, 7, 8]] != 0)


@pytest.mark.parametrize("mode", MODES)
def test_sapo_gradient_at_ratio_one_is_plain_policy_gradient(mode: str) -> None:
    cfg = make_cfg("sapo", mode, kl_coef=0.0, entropy_coef=0.0, tis_cap=None, sapo_tau_pos=0.7, sapo_tau_neg=3.0)
    lv = leaves()
    loss, metrics = get_algorithm("sapo").loss(make_inputs(lv, [0, 1, 2, 3, 4], old_is_logp=True), cfg)
    (g_sapo,) = torch.autograd.grad(loss, [lv.logp])
    # plain REINFORCE-style objective: -agg(A * sample_weight * logp), whose gradient is -A * w * agg weight
    lv_pg = leaves()
    per_seq = [
        [-SEQ_ADV[s] * SAMPLE_W[t] * lv_pg.logp[t] for t in range(st, st + n) if MASK[t]]
        for s, (st, n) in enumerate(zip(STARTS, SEQ_LENS, strict=True))
    ]
    (g_pg,) = torch.autograd.grad(ref_agg(per_seq, mode), [lv_pg.logp])
    torch.testing.assert_close(g_sapo, g_pg, rtol=1e-12, atol=1e-14)
    assert metrics[PG_CLIPFRAC].item() == 0.0


def test_sapo_gradient_decays_far_from_ratio_one() -> None:
    cfg = make_cfg("sapo", "token_mean", kl_coef=0.0, entropy_coef=0.0, tis_cap=None)
    x_near, x_far = (make_inputs(lv, [0], sample_weights=False) for lv in (leaves(), leaves()))
    x_near.old_logprobs = x_near.logprobs.detach().clone()  # r = 1
    x_far.old_logprobs = x_far.logprobs.detach() - 3.0  # r = e^3
    g = []
    for x in (x_near, x_far):
        loss, _ = get_algorithm("sapo").loss(x, cfg)
        (gr,) = torch.autograd.grad(loss, [x.logprobs])
        g.append(gr.item())
    # d loss / d logp = -A * 4p(1-p) * r / N; at r = 1 that is -A / N
    r = math.exp(3.0)
    p = 1.0 / (1.0 + math.exp(-(r - 1.0)))
    assert g[0] == pytest.approx(-1.0 / NUM_TOKENS)
    assert g[1] == pytest.approx(-4 * p * (1 - p) * r / NUM_TOKENS)
    assert abs(g[1]) < 1e-5 * abs(g[0])


@pytest.mark.parametrize("algo", ALGOS)
def test_no_proximal_means_unit_tis_weight(algo: str) -> None:
    """old == rollout (not proximal): the TIS weight is 1, so tis_cap changes nothing."""
    results = []
    for cap in (2.0, None):
        x = make_inputs(leaves(), [0, 1, 2, 3, 4])
        x.rollout_logprobs = x.old_logprobs
        loss, m = get_algorithm(algo).loss(x, make_cfg(algo, "token_mean", tis_cap=cap))
        assert m[TIS_WEIGHT_MEAN].item() == pytest.approx(1.0) and m[TIS_CLIPFRAC].item() == 0.0
        results.append(loss.item())
    assert results[0] == pytest.approx(results[1], rel=1e-14)


def test_distill_sequence_advantages_and_requirements() -> None:
    rewards, groups = np.array([1.0, 0.0, 3.0, 3.0]), np.array([0, 0, 1, 1])
    cfg = make_cfg("distill", "token_mean", distill=DistillConfig(coef=1.0, reward_coef=0.5), std_normalize=False)
    np.testing.assert_allclose(get_algorithm("distill").sequence_advantages(rewards, groups, cfg), [0.25, -0.25, 0, 0])
    cfg = make_cfg("distill", "token_mean")  # reward_coef 0: pure distillation
    assert np.all(get_algorithm("distill").sequence_advantages(rewards, groups, cfg) == 0)
    x = make_inputs(leaves(), [0, 1])
    x.teacher_logprobs = None
    with pytest.raises(ValueError, match="teacher_logprobs"):
        get_algorithm("distill").loss(x, cfg)


def test_missing_reference_or_entropy_is_an_error() -> None:
    x = make_inputs(leaves(), [0, 1])
    x.ref_logprobs = None
    with pytest.raises(ValueError, match="ref_logprobs"):
        get_algorithm("grpo").loss(x, make_cfg("grpo", "token_mean"))
    x = make_inputs(leaves(), [0, 1])
    x.entropy = None
    with pytest.raises(ValueError, match="entropy"):
        get_algorithm("grpo").loss(x, make_cfg("grpo", "token_mean"))
    # both off: no KL / entropy metrics, and a float32 batch stays float32
    x = make_inputs(leaves(), [0, 1], sample_weights=False)
    for name in ("logprobs", "old_logprobs", "rollout_logprobs", "advantages", "loss_mask"):
        setattr(x, name, getattr(x, name).float())
    x.ref_logprobs = x.entropy = x.teacher_logprobs = None
    loss, m = get_algorithm("grpo").loss(x, make_cfg("grpo", "token_mean", kl_coef=0.0, entropy_coef=0.0))
    assert loss.dtype == torch.float32
    assert KL_LOSS not in m and ENTROPY_LOSS not in m


@pytest.mark.parametrize("algo", ALGOS)
def test_minus_inf_old_logprob_on_masked_token_gives_finite_gradient(algo: str) -> None:
    """A masked-out token (tool output nobody sampled) may carry a -inf log-prob: masked before the exponential."""
    lv = leaves()
    x = make_inputs(lv, [0, 1, 2, 3, 4])
    masked_out = [t for t, m in enumerate(MASK) if not m]
    old = x.old_logprobs.clone()
    old[masked_out] = -math.inf
    x.old_logprobs = old
    x.rollout_logprobs = x.rollout_logprobs.clone()
    x.rollout_logprobs[masked_out] = -math.inf
    loss, metrics = get_algorithm(algo).loss(x, make_cfg(algo, "seq_mean_token_mean"))
    (g,) = torch.autograd.grad(loss, [lv.logp])
    assert torch.isfinite(loss) and torch.all(torch.isfinite(g))
    assert torch.all(g[masked_out] == 0)
    assert all(math.isfinite(float(v)) for v in metrics.values())
    # the masked-in tokens' loss is unchanged by what the masked-out ones hold
    ref, _ = get_algorithm(algo).loss(make_inputs(leaves(), [0, 1, 2, 3, 4]), make_cfg(algo, "seq_mean_token_mean"))
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)


def test_sapo_gate_metric_uses_the_temperature_in_the_inputs_dtype() -> None:
    """tau = 1.1 is not a float32 number: the gate-weight metric must use it in float64 like the loss does."""
    cfg = make_cfg("sapo", "token_mean", tis_cap=None, sapo_tau_pos=1.1, sapo_tau_neg=1.3)
    x = make_inputs(leaves(), [0, 1, 2, 3, 4])
    _, metrics = get_algorithm("sapo").loss(x, cfg)
    want = 0.0
    for t in range(len(LOGP)):
        if MASK[t]:
            adv = [SEQ_ADV[s] for s in range(len(SEQ_LENS)) for _ in range(SEQ_LENS[s])][t]
            tau = 1.1 if adv > 0 else 1.3
            p = 1.0 / (1.0 + math.exp(-tau * (math.exp(DELTA[t]) - 1.0)))
            want += 4 * p * (1 - p)
    assert metrics["train/sapo_gate_weight"].item() == pytest.approx(want / NUM_TOKENS, rel=1e-14, abs=0)
