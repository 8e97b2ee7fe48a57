"""Conformance suite of the trainer backend protocol (relax_hpc/trainer/backend.py), for any backend.

A backend's test module imports these tests (``from backend_conformance import *``) and defines the fixture
``backend_factory``: an object with ``make(cfg, seed) -> TrainerBackend`` (a tiny Qwen3 policy built from config with
random weights from ``seed``, float32 on the CPU) and ``tokenizer``. The suite checks, against plain torch written out
here, that:

* one step equals a straightforward reference step (the same GRPO loss on unpacked sequences, written directly;
  AdamW; gradient clipping), for a token-normalised and a sequence-normalised ``loss_agg``, with the step's metrics;
* stale samples (``stale_policy: flag``) are clipped around the current policy and re-weighted by truncated IS;
* a checkpoint round trip through real checkpoint files is bitwise (weights, optimizer, and the next step), in the
  project's format and in the backend's sharded format where it has one;
* the HF export loads with ``from_pretrained`` and gives the same logits;
* the full state (and its buckets) come under HF names, and ``copy=True`` is safe past the next step.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from relax_hpc.config.load import validate_dict
from relax_hpc.config.schema import RecipeConfig
from relax_hpc.rundir import RunDir
from relax_hpc.trainer.backend import TrainerBackend
from relax_hpc.trainer.batch import TrainItem
from relax_hpc.trainer.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_sharded_checkpoint,
    read_checkpoint_state,
    save_checkpoint,
    save_sharded_checkpoint,
)

__all__ = [
    "make_cfg",
    "make_items",
    "reference_model",
    "reference_step",
    "test_checkpoint_round_trip_is_bitwise",
    "test_hf_export_loads_and_gives_same_logits",
    "test_layout_is_consistent",
    "test_sharded_checkpoint_round_trip_is_bitwise",
    "test_stale_items_are_clipped_around_current_policy_and_is_weighted",
    "test_state_is_hf_named_and_copy_is_private",
    "test_step_equals_reference_step",
    "test_step_without_items_keeps_weights_and_reports_every_metric",
]


def make_cfg(**over: Any) -> RecipeConfig:
    """A tiny-model recipe; ``over`` maps dotted-free section names to field overrides (``algorithm={...}``)."""
    sections: dict[str, Any] = {
        "data": {"task": {"name": "reverse_digits"}}, "model": {"path": "tiny"},
        "trainer": {"lr": 1e-3, "micro_batch_tokens": 40, "device": "cpu", "grad_clip": 1.0},
        "rollout": {"sampling": {"max_new_tokens": 8, "temperature": 0.8}},
    }
    for name, fields in over.items():
        sections[name] = {**sections.get(name, {}), **fields}
    return validate_dict(sections)


def with_trainer(cfg: RecipeConfig, **fields: Any) -> RecipeConfig:
    """``cfg`` with ``trainer`` fields changed, ``backend`` included: the variant is chosen again (the keys only the
    old variant has are dropped, as a ``--set trainer.backend=...`` does)."""
    from relax_hpc.config.load import config_to_json, validate_resolved

    data = config_to_json(cfg)
    data["trainer"] = {**data["trainer"], **fields}
    return validate_resolved(data)


def make_items(n: int = 12, seed: int = 0, *, stale_every: int = 0) -> list[TrainItem]:
    """Random prompt/response items in groups of 4, with a tool token masked out and varied lengths."""
    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        p = rng.integers(4, 18, size=rng.integers(3, 9))
        r = rng.integers(4, 18, size=rng.integers(1, 9))
        mask = np.ones(len(r), dtype=np.float32)
        if len(r) > 2:
            mask[1] = 0
        items.append(TrainItem.of(prompt_ids=p, response_ids=r,
                               logprobs=-np.abs(rng.normal(2.8, 0.5, len(r))).astype(np.float32),
                               loss_mask=mask, advantage=float(rng.normal()), reward=float(rng.random()),
                               group_id=f"g{i // 4}", stale=bool(stale_every and i % stale_every == 0)))
    return items


def reference_model(backend: TrainerBackend) -> Any:
    """A plain HF model (from the backend's config) holding the backend's current weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(backend.hf_config())
    model_type = cfg.pop("model_type")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg), dtype=torch.float32)
    model.load_state_dict(backend.full_state_dict(copy=True), strict=False)
    model.tie_weights()
    return model.train()


def _logprobs(model: Any, it: TrainItem, temperature: float) -> torch.Tensor:
    ids = torch.as_tensor(np.concatenate([it.sample.prompt_ids, it.sample.response_ids]), dtype=torch.long)[None]
    p = len(it.sample.prompt_ids)
    logits = model(input_ids=ids, use_cache=False).logits[0, p - 1:-1].float() / temperature
    targets = torch.as_tensor(it.sample.response_ids, dtype=torch.long)
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]


def reference_step(model: Any, items: list[TrainItem], cfg: RecipeConfig) -> dict[str, float]:
    """One GRPO step written out directly on unpacked sequences: ratio to the rollout log-probs (to the current
    policy's own for stale items, with the truncated IS weight against the rollout), clip-higher surrogate, the
    ``loss_agg`` reduction over the whole step, AdamW, gradient-norm clipping. Returns its metrics."""
    a, t = cfg.algorithm, cfg.trainer
    temp = cfg.rollout.sampling.temperature
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=t.lr, betas=tuple(t.betas),
                            weight_decay=t.weight_decay, foreach=False)
    opt.zero_grad()
    per_seq, masks, clipped, kl, tis = [], [], [], [], []
    for it in items:
        logp = _logprobs(model, it, temp)
        rollout = torch.as_tensor(it.sample.logprobs, dtype=torch.float32)
        old = logp.detach() if it.sample.stale else rollout
        w = torch.exp(old - rollout).clamp(max=a.tis_cap)
        ratio = torch.exp(logp - old)
        adv = torch.full_like(logp, it.advantage)
        unclipped, clip = -adv * ratio, -adv * ratio.clamp(1 - a.clip_low, 1 + a.clip_high)
        loss_t = torch.maximum(unclipped, clip) * w
        m = torch.as_tensor(it.sample.loss_mask, dtype=torch.float32)
        per_seq.append(loss_t * m)
        masks.append(m)
        clipped.append((clip > unclipped).float() * m)
        kl.append((old - logp).detach() * m)
        tis.append(w * m)
    n_tok = float(sum(m.sum() for m in masks))
    live = [i for i, m in enumerate(masks) if m.sum() > 0]
    if a.loss_agg == "token_mean":
        loss = sum(v.sum() for v in per_seq) / n_tok
    elif a.loss_agg == "seq_mean_token_mean":
        loss = sum(per_seq[i].sum() / masks[i].sum() for i in live) / len(live)
    else:
        raise AssertionError(f"the reference step writes out token_mean and seq_mean_token_mean, not {a.loss_agg}")
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
    opt.step()
    return {"train/loss": float(loss.detach()), "train/grad_norm": float(grad_norm),
            "train/pg_clipfrac": float(sum(c.sum() for c in clipped)) / n_tok,
            "train/ppo_kl": float(sum(k.sum() for k in kl)) / n_tok,
            "train/tis_weight_mean": float(sum(w.sum() for w in tis)) / n_tok}


def _assert_weights_close(backend: TrainerBackend, model: Any, before: dict[str, torch.Tensor],
                          outliers: float = 0.0) -> None:
    """The backend's update equals the reference's (compared as updates: AdamW's first update is about ``lr`` per
    element, and an element whose gradient is near AdamW's eps may differ by a few percent of ``lr`` between
    packed and unpacked forward passes). ``outliers``: the fraction of a tensor's elements allowed outside the
    tolerance, still within ``lr`` (a GPU's float32 kernels round differently from the CPU reference: the eps
    effect then reaches a few elements in ten thousand)."""
    ref = model.state_dict()
    moved = 0
    for name, w in backend.full_state_dict().items():
        d_backend, d_ref = w - before[name], ref[name] - before[name]
        off = (d_backend - d_ref).abs() > 5e-5 + 1e-3 * d_ref.abs()
        if outliers and int(off.sum()) <= outliers * off.numel():
            assert float((d_backend - d_ref).abs().max()) < 1e-3, name  # the suite's lr
        else:
            torch.testing.assert_close(d_backend, d_ref, atol=5e-5, rtol=1e-3, msg=lambda m, n=name: f"{n}: {m}")
        moved += int(d_ref.abs().max() > 0)
    assert moved > 0  # the step changed the weights at all


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean"])
def test_step_equals_reference_step(backend_factory: Any, loss_agg: str) -> None:
    cfg = make_cfg(algorithm={"loss_agg": loss_agg})
    backend = backend_factory.make(cfg, seed=0)
    before = backend.full_state_dict(copy=True)
    model = reference_model(backend)
    items = make_items(12)
    want = reference_step(model, copy.deepcopy(items), cfg)
    got = backend.train_step(copy.deepcopy(items))
    assert backend.step == 1
    _assert_weights_close(backend, model, before, getattr(backend_factory, "outliers", 0.0))
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    assert 0.0 < got["train/pg_clipfrac"] <= 1.0  # a token fraction, whatever the loss normaliser
    # streamed: the same step as groups arriving one at a time
    streamed = backend_factory.make(cfg, seed=0)
    streamed.begin_step()
    for g in range(3):
        streamed.accumulate(copy.deepcopy(items[4 * g:4 * g + 4]))
    got2 = streamed.finish_step()
    for key in want:
        assert got2[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


def test_step_without_items_keeps_weights_and_reports_every_metric(backend_factory: Any) -> None:
    """A step whose plan brought no items to this rank (its groups all dropped as stale, or a data-parallel rank
    without data): the same metric names as a step with items, zero loss, weights unchanged, the step counted."""
    cfg = make_cfg()
    full = backend_factory.make(cfg, seed=0).train_step(make_items(4))
    backend = backend_factory.make(cfg, seed=0)
    before = backend.full_state_dict(copy=True)
    backend.begin_step()
    got = backend.finish_step()
    assert backend.step == 1 and set(full) <= set(got), set(full) - set(got)
    assert got["train/loss"] == 0.0
    after = backend.full_state_dict(copy=True)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_stale_items_are_clipped_around_current_policy_and_is_weighted(backend_factory: Any) -> None:
    cfg = make_cfg()
    backend = backend_factory.make(cfg, seed=1)
    before = backend.full_state_dict(copy=True)
    model = reference_model(backend)
    items = make_items(12, seed=3, stale_every=3)
    want = reference_step(model, copy.deepcopy(items), cfg)
    got = backend.train_step(copy.deepcopy(items))
    _assert_weights_close(backend, model, before, getattr(backend_factory, "outliers", 0.0))
    assert got["train/tis_weight_mean"] == pytest.approx(want["train/tis_weight_mean"], rel=1e-4)
    assert got["train/tis_weight_mean"] != pytest.approx(1.0, abs=1e-3)  # the stale ones are re-weighted
    unflagged = [dataclasses.replace(it, sample=dataclasses.replace(it.sample, stale=False)) for it in items]
    fresh = backend_factory.make(cfg, seed=1).train_step(unflagged)
    assert fresh["train/tis_weight_mean"] == pytest.approx(1.0)


def test_checkpoint_round_trip_is_bitwise(backend_factory: Any, tmp_path: Path) -> None:
    cfg = make_cfg()
    a = backend_factory.make(cfg, seed=0)
    a.train_step(make_items(8, seed=1))
    model_sd, optim_sd = a.checkpoint_state()
    rd = RunDir.create(tmp_path / "run")
    save_checkpoint(rd, a.step, model_sd=model_sd, optim_sd=optim_sd, state={"store_position": {"writers": {}}})
    path = latest_checkpoint(rd)
    assert path is not None
    b = backend_factory.make(cfg, seed=7)  # other initial weights: everything must come from the files
    msd, osd, _ = load_checkpoint(path)
    b.load_checkpoint_state(msd, osd)
    b.step = a.step
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = a.checkpoint_state()[1], b.checkpoint_state()[1]
    assert oa["state"].keys() == ob["state"].keys()
    for k in oa["state"]:
        for f, v in oa["state"][k].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(ob["state"][k][f])), (k, f)
    items = make_items(8, seed=2)
    ma, mb = a.train_step(copy.deepcopy(items)), b.train_step(copy.deepcopy(items))
    assert ma["train/loss"] == mb["train/loss"]
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_sharded_checkpoint_round_trip_is_bitwise(backend_factory: Any, tmp_path: Path) -> None:
    """Where the backend has a sharded format (``sharded_checkpoint``), a checkpoint published in it loads into a
    fresh backend bit for bit, and both take the same next step."""
    cfg = make_cfg()
    a = backend_factory.make(cfg, seed=0)
    sharded = a.sharded_checkpoint()
    if sharded is None:
        pytest.skip("the backend has no sharded checkpoint format")
    for seed in (1, 11):
        a.train_step(make_items(8, seed=seed))
    rd = RunDir.create(tmp_path / "run")
    save_sharded_checkpoint(rd, a.step, sharded, rank=0, world_size=1, state={"store_position": {}}, keep=2,
                            timeout_s=60)
    path = latest_checkpoint(rd)
    assert path is not None and (path / sharded.name).is_dir()
    b = backend_factory.make(cfg, seed=7)
    reader = b.sharded_checkpoint()
    load_sharded_checkpoint(path, read_checkpoint_state(path), reader)
    b.step = a.step
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    items = make_items(8, seed=2)
    ma, mb = a.train_step(copy.deepcopy(items)), b.train_step(copy.deepcopy(items))
    assert ma["train/loss"] == mb["train/loss"] and ma["train/grad_norm"] == mb["train/grad_norm"]
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    sharded.close()
    reader.close()


def test_hf_export_loads_and_gives_same_logits(backend_factory: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = backend_factory.make(make_cfg(), seed=0)
    backend.train_step(make_items(8, seed=4))
    out = tmp_path / "export"
    backend.export_hf(out, backend_factory.tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(out).get_vocab() == backend_factory.tokenizer.get_vocab()
    ref = reference_model(backend).eval()
    ids = torch.as_tensor([[1, 5, 9, 4, 17, 13, 6]])
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert torch.equal(got, want)
    live = backend.generation_model()
    if live is not None:
        with torch.no_grad():
            logits = live(input_ids=ids.to(next(live.parameters()).device)).logits.cpu()
        torch.testing.assert_close(logits, got, atol=1e-6, rtol=1e-6)


def test_state_is_hf_named_and_copy_is_private(backend_factory: Any) -> None:
    backend = backend_factory.make(make_cfg(), seed=0)
    sd = backend.full_state_dict()
    assert "model.embed_tokens.weight" in sd and any(k.startswith("model.layers.0.") for k in sd)
    assert all(t.device.type == "cpu" for t in sd.values())
    buckets = list(backend.state_buckets(4096))
    assert len(buckets) > 1
    merged = {k: v for b in buckets for k, v in b.items()}
    assert merged.keys() == sd.keys() and all(torch.equal(merged[k], sd[k]) for k in sd)
    private = backend.full_state_dict(copy=True)
    snapshot = {k: v.clone() for k, v in private.items()}
    backend.train_step(make_items(8, seed=5))
    assert all(torch.equal(private[k], snapshot[k]) for k in private)  # untouched by the step
    after = backend.full_state_dict()
    assert any(not torch.equal(after[k], snapshot[k]) for k in after)
    config = backend.hf_config()
    assert config["model_type"] == "qwen3" and config["vocab_size"] == sd["model.embed_tokens.weight"].shape[0]


def test_layout_is_consistent(backend_factory: Any) -> None:
    backend = backend_factory.make(make_cfg(), seed=0)
    assert 0 <= backend.dp_rank < backend.dp_size <= backend.world_size
    assert backend.world_size % backend.dp_size == 0
    assert backend.step == 0
