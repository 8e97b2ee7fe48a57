"""The megatron backend's distributed optimizer (megatron-core's; on the CPU through the shim of
relax_hpc/trainer/megatron/optim.py), its ``dist_checkpointing`` checkpoints and recompute, at DP=1 in this process
(one in-process gloo rank). The two-process DP=2 checks (steps against the torch backend, a DP=2 checkpoint loaded at
DP=1) are in tests/integration/test_megatron_tp.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install -e '.[megatron]'")

from relax_hpc.algorithms.registry import get_algorithm
from relax_hpc.errors import UserError
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
from relax_hpc.trainer.backend import make_backend
from tests.helpers.backend_conformance import make_cfg, make_items
from tests.helpers.megatron_fixtures import megatron_process_group  # noqa: F401  (autouse: the group gone after the module)


def make(seed: int = 3, *, dist_opt: bool = True, recompute: bool = False, dtype: Any = torch.float32,
         **trainer: Any) -> Any:
    tok = build_digits_tokenizer()
    cfg = make_cfg(trainer={"backend": "megatron", "megatron": {"distributed_optimizer": dist_opt}, **trainer},
                   model={"path": "tiny", "gradient_checkpointing": recompute})
    hf = build_tiny_model(cfg.model.tiny, len(tok), seed=seed, pad_token_id=tok.pad_token_id,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    return make_backend(cfg, rank=0, world_size=1, device="cpu", dtype=dtype,
                        algorithm=get_algorithm("grpo"), tokenizer=tok, model=hf.to(dtype))


def test_the_distributed_optimizer_is_megatrons_and_steps_as_adamw() -> None:
    """Three steps (weight decay on, clipping active) of megatron's distributed optimizer equal torch's AdamW path
    within float32 rounding: losses, gradient norms, weights."""
    from megatron.core.optimizer import ChainedOptimizer

    a, b = make(dist_opt=True, weight_decay=0.1), make(dist_opt=False, weight_decay=0.1)
    assert isinstance(a.optimizer, ChainedOptimizer) and isinstance(b.optimizer, torch.optim.AdamW)
    for step in range(3):
        items = make_items(12, seed=20 + step)
        ma, mb = a.train_step(copy.deepcopy(items)), b.train_step(copy.deepcopy(items))
        assert ma["train/loss"] == pytest.approx(mb["train/loss"], rel=1e-5, abs=1e-7)
        assert ma["train/grad_norm"] == pytest.approx(mb["train/grad_norm"], rel=1e-5)
        assert ma["train/grad_norm"] > a.cfg.trainer.grad_clip  # the clipping is exercised
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert max(float((sa[k] - sb[k]).abs().max()) for k in sa) < 1e-5
    oa, ob = a.checkpoint_state()[1]["state"], b.checkpoint_state()[1]["state"]
    assert oa.keys() == ob.keys()
    for k in oa:
        assert torch.equal(oa[k]["step"], ob[k]["step"])
        torch.testing.assert_close(oa[k]["exp_avg"], ob[k]["exp_avg"], rtol=1e-4, atol=1e-7)


def test_dist_checkpoint_resumes_bitwise(tmp_path: Path) -> None:
    """megatron's dist_checkpointing of model and distributed optimizer: a fresh backend (other initial weights,
    no optimizer state yet) loads it; weights, moments and the next step are the saved run's, bit for bit."""
    a = make(seed=0)
    for seed in (1, 11):  # two steps: megatron's dummy state of a fresh optimizer is at step 1
        a.train_step(make_items(8, seed=seed))
    a.save_dist_checkpoint(tmp_path / "ckpt")
    b = make(seed=7)
    b.load_dist_checkpoint(tmp_path / "ckpt")
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = a.checkpoint_state()[1]["state"], b.checkpoint_state()[1]["state"]
    assert all(torch.equal(oa[k][f], ob[k][f]) for k in oa for f in ("exp_avg", "exp_avg_sq", "step"))
    items = make_items(8, seed=2)
    ma, mb = a.train_step(copy.deepcopy(items)), b.train_step(copy.deepcopy(items))
    assert ma["train/loss"] == mb["train/loss"] and ma["train/grad_norm"] == mb["train/grad_norm"]
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_project_checkpoint_moves_between_the_two_optimizers() -> None:
    """The project's HF-named checkpoint of the distributed optimizer loads into the AdamW path and back, bitwise."""
    a = make(seed=0)
    a.train_step(make_items(8, seed=1))
    msd, osd = a.checkpoint_state()
    b = make(seed=5, dist_opt=False)
    b.load_checkpoint_state(msd, osd)
    c = make(seed=6)
    c.load_checkpoint_state(*b.checkpoint_state())
    oa, oc = osd["state"], c.checkpoint_state()[1]["state"]
    assert all(torch.equal(oa[k][f], oc[k][f]) for k in oa for f in ("exp_avg", "exp_avg_sq", "step"))
    sa, sc = a.full_state_dict(), c.full_state_dict()
    assert all(torch.equal(sa[k], sc[k]) for k in sa)


def test_dist_checkpoint_needs_the_distributed_optimizer(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="distributed_optimizer: true"):
        make(dist_opt=False).save_dist_checkpoint(tmp_path / "x")


def test_recompute_leaves_loss_and_gradients_unchanged() -> None:
    """``model.gradient_checkpointing`` recomputes each layer in the backward pass (megatron's full, uniform
    recompute): the loss and every gradient are the plain run's."""
    plain, again = make(recompute=False), make(recompute=True)
    assert again.gpt.config.recompute_granularity == "full" and plain.gpt.config.recompute_granularity is None
    items = make_items(12, seed=4)
    grads = []
    for backend in (plain, again):
        backend.begin_step()
        backend.accumulate(copy.deepcopy(items))
        grads.append({n: p.main_grad.clone() for n, p in backend.params.items()})
        backend.begin_step()
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-6, atol=1e-7)
    ma, mb = plain.train_step(copy.deepcopy(items)), again.train_step(copy.deepcopy(items))
    assert ma["train/loss"] == pytest.approx(mb["train/loss"], rel=1e-6)


def test_sft_warmup_with_the_distributed_optimizer_leaves_a_fresh_optimizer() -> None:
    """The warm-up steps megatron's optimizer with its own hyper-parameters, then restores them and drops the
    state (RL starts from zero moments, as with the torch backend's separate warm-up AdamW)."""
    from relax_hpc.modes.trainer_role import warmup_stream
    from relax_hpc.trainer.megatron.optim import has_state

    b = make()
    before = [dict(lr=g["lr"], weight_decay=g["weight_decay"]) for g in b.optimizer.param_groups]
    w0 = {k: v.clone() for k, v in b.full_state_dict().items()}
    tok = build_digits_tokenizer()
    out = b.sft_warmup(warmup_stream(b.cfg, tok), tok, steps=2, lr=1e-3, batch_size=4, max_tokens=64)
    assert out["warmup/steps"] == 2.0 and out["warmup/loss"] == out["warmup/loss"]
    assert not has_state(b.optimizer)
    assert [dict(lr=g["lr"], weight_decay=g["weight_decay"]) for g in b.optimizer.param_groups] == before
    assert any(not torch.equal(w0[k], v) for k, v in b.full_state_dict().items())


def test_bfloat16_model_is_all_bfloat16_and_its_dist_checkpoint_resumes(tmp_path: Path) -> None:
    """In bfloat16 every parameter is bfloat16 (the local spec's RMSNorm weights are made in float32): megatron's
    parameter-to-state map holds then, each parameter's main weights and moments are its own range (with float32
    norms in the same param group they were another parameter's, and the dist_checkpointing save failed, as on the
    H200); both checkpoint formats resume with the same weights, main weights and moments."""
    from relax_hpc.trainer.megatron.optim import _ranges, build_distributed_optimizer

    a = make(seed=0, dtype=torch.bfloat16)
    assert {p.dtype for p in a.gpt.parameters()} == {torch.bfloat16}
    a.train_step(make_items(8, seed=1))
    for opt, param, rng in _ranges(a.optimizer):
        mine = opt._get_main_param_and_optimizer_states(param)
        assert {k: v.numel() for k, v in mine.items() if v.dim()} == dict.fromkeys(("param", "exp_avg",
                                                                                  "exp_avg_sq"), rng.size)
    a.save_dist_checkpoint(tmp_path / "ckpt")
    msd, osd = a.checkpoint_state()
    for load in ("dist", "project"):
        b = make(seed=7, dtype=torch.bfloat16)
        if load == "dist":
            b.load_dist_checkpoint(tmp_path / "ckpt")
        else:
            b.load_checkpoint_state(msd, osd)
        sb = b.full_state_dict()
        assert all(torch.equal(msd[k], sb[k]) for k in msd), load
        ob = b.checkpoint_state()[1]["state"]
        assert all(torch.equal(osd["state"][k][f], ob[k][f]) for k in ob
                   for f in ("exp_avg", "exp_avg_sq", "main_param", "step")), load
    next(iter(a.gpt.parameters())).data = next(iter(a.gpt.parameters())).data.float()
    with pytest.raises(ValueError, match=r"every parameter in torch\.bfloat16"):
        build_distributed_optimizer(a.cfg.trainer, a.model, torch.bfloat16)
