"""The megatron backend on a GPU: torch's flash varlen kernel (one call per micro-batch, bfloat16) gives the
per-sequence SDPA loop's output and gradients within bfloat16 rounding; megatron's distributed optimizer in bfloat16
(float32 main weights) steps and resumes bit for bit from both checkpoint formats. Marked ``gpu``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install -e '.[megatron]'")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_varlen_kernel_matches_the_per_sequence_loop() -> None:
    from relax_hpc.trainer.megatron.layers import sdpa_per_sequence, varlen_causal

    torch.manual_seed(0)
    lengths = [37, 300, 1, 129, 512]
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    t = sum(lengths)
    q = torch.randn(t, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    fast = varlen_causal(q, k, v, cu.cuda(), max(lengths), None)
    assert fast is not None, "torch >= 2.10 on CUDA has the varlen kernel"
    slow = sdpa_per_sequence(q, k, v, cu, None)
    assert fast.shape == slow.shape == (t, 16, 128)
    torch.testing.assert_close(fast, slow, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(fast)
    grads_fast = torch.autograd.grad(fast, (q, k, v), g)
    grads_slow = torch.autograd.grad(slow, (q, k, v), g)
    for a, b in zip(grads_fast, grads_slow, strict=True):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
    assert varlen_causal(q.float(), k.float(), v.float(), cu.cuda(), max(lengths), None) is None  # float32: the loop


def _hf(cfg: object, seed: int) -> object:
    from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model

    tok = build_digits_tokenizer()
    return build_tiny_model(cfg.model.tiny, len(tok), seed=seed, pad_token_id=tok.pad_token_id).to(torch.bfloat16)


def _backend(seed: int, *, dist_opt: bool = True, **trainer: object) -> object:
    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.trainer.backend import make_backend
    from tests.helpers.backend_conformance import make_cfg

    cfg = make_cfg(trainer={"backend": "megatron", "device": "cuda", "weight_decay": 0.1,
                            "megatron": {"distributed_optimizer": dist_opt}, **trainer})
    return make_backend(cfg, rank=0, world_size=1, device="cuda", dtype=torch.bfloat16,
                        algorithm=get_algorithm("grpo"), tokenizer=build_digits_tokenizer(), model=_hf(cfg, seed))


def test_packed_logprobs_are_the_hf_models_per_sequence() -> None:
    """One packed micro-batch of 12 sequences through the megatron GPT (the varlen kernel, RoPE gathered at each
    token's position): every response token's log-prob is the HF model's on that sequence alone, in bfloat16."""
    from relax_hpc.trainer.batch import pack
    from tests.helpers.backend_conformance import make_items

    tr = _backend(0)
    hf = _hf(tr.cfg, 0).cuda().eval()
    items = make_items(12, seed=3)
    (mb,) = pack(items, 1 << 20, device="cuda", rows=False)
    with torch.no_grad():
        got = tr.sequence_logprobs(tr.model, mb)[0].float().cpu()
        want = []
        for it in mb.items:
            ids = torch.as_tensor(list(it.sample.prompt_ids) + list(it.sample.response_ids), device="cuda")[None]
            logits = hf(input_ids=ids).logits[0, len(it.sample.prompt_ids) - 1:-1].float() / tr.temperature
            want.append(torch.log_softmax(logits, -1).gather(-1, ids[0, len(it.sample.prompt_ids):, None])[:, 0].cpu())
    torch.testing.assert_close(got, torch.cat(want), atol=3e-2, rtol=0)


def test_compiled_layers_train_like_the_eager_ones() -> None:
    """``trainer.compile_layers`` on the megatron GPT (megatron's TransformerLayers compiled around the packed
    attention): three steps give the eager backend's losses and gradient norms within bfloat16 rounding, and the
    compiled forward really ran (no fallback)."""
    import copy

    from tests.helpers.backend_conformance import make_items

    eager, compiled = _backend(0), _backend(0, compile_layers=True)
    for step in range(3):
        items = make_items(12, seed=40 + step)
        me, mc = eager.train_step(copy.deepcopy(items)), compiled.train_step(copy.deepcopy(items))
        assert mc["train/loss"] == pytest.approx(me["train/loss"], rel=2e-2, abs=1e-3)
        assert mc["train/grad_norm"] == pytest.approx(me["train/grad_norm"], rel=5e-2)
    assert not compiled.compiled_ctx.__self__.failed


def test_distributed_optimizer_in_bfloat16_steps_and_resumes_bitwise(tmp_path: Path) -> None:
    """On CUDA in bfloat16 (megatron's optimizer without the CPU shim; float32 main weights apart from the model's):
    steps follow torch's AdamW on the bfloat16 weights within bfloat16 rounding; megatron's dist_checkpointing and
    the project's checkpoint (with the main weights as ``main_param``) both resume bit for bit."""
    import copy

    from megatron.core.optimizer import ChainedOptimizer

    from tests.helpers.backend_conformance import make_items

    a, ref = _backend(0), _backend(0, dist_opt=False)
    assert isinstance(a.optimizer, ChainedOptimizer)
    for step in range(3):
        items = make_items(12, seed=20 + step)
        ma, mr = a.train_step(copy.deepcopy(items)), ref.train_step(copy.deepcopy(items))
        assert ma["train/loss"] == pytest.approx(mr["train/loss"], rel=2e-2, abs=1e-3)
    a.save_dist_checkpoint(tmp_path / "dist")
    msd, osd = a.checkpoint_state()
    assert all("main_param" in s for s in osd["state"].values())
    loaded = {}
    for load in ("dist", "project"):
        b = _backend(7)
        if load == "dist":
            b.load_dist_checkpoint(tmp_path / "dist")
        else:
            b.load_checkpoint_state(msd, osd)
        b.step = a.step
        sa, sb = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), load
        ob = b.checkpoint_state()[1]["state"]
        assert all(torch.equal(osd["state"][k][f], ob[k][f]) for k in ob
                   for f in ("exp_avg", "exp_avg_sq", "main_param", "step")), load
        loaded[load] = b
    items = make_items(8, seed=2)
    want = a.train_step(copy.deepcopy(items))["train/loss"]
    sa = a.full_state_dict()
    for load, b in loaded.items():
        assert b.train_step(copy.deepcopy(items))["train/loss"] == want, load
        sb = b.full_state_dict()
        assert all(torch.equal(sa[k], sb[k]) for k in sa), load
