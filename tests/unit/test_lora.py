"""LoRA (``model.lora``): the recipe checks through the CLI, the torch backend training only the adapter, adapter
snapshots that PEFT loads, adapter checkpoints with their optimizer state, and the hf engine merging adapters."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from tests.helpers.backend_conformance import make_cfg, make_items
from tests.helpers.badinput import assert_one_error, run_cli

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo.yaml"
LORA = {"lora": {"rank": 4, "alpha": 8.0}}


def _backend(cfg):
    from relax_hpc.algorithms import registry
    from relax_hpc.models.load import load_model, load_tokenizer
    from relax_hpc.trainer.backend import make_backend

    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, device="cpu", dtype=torch.float32)
    return make_backend(cfg, rank=0, world_size=1, device="cpu", dtype=torch.float32,
                        algorithm=registry.get_algorithm(cfg.algorithm.name), tokenizer=tok, model=model), tok


def _fresh_base(cfg):
    from relax_hpc.models.load import load_model, load_tokenizer

    return load_model(cfg.model, load_tokenizer(cfg.model), device="cpu", dtype=torch.float32).eval()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _train_steps(backend, n: int = 2) -> None:
    for k in range(n):
        backend.begin_step()
        backend.accumulate(make_items(seed=k))
        backend.finish_step()


# ------------------------------------------------------------------------------------------------- recipe checks
def test_rank_zero_is_refused_in_one_line() -> None:
    assert_one_error(run_cli("validate", str(DEMO), "--set", "model.lora={rank: 0}"), "model.lora.rank")


def test_lora_with_megatron_is_refused_in_one_line() -> None:
    assert_one_error(run_cli("validate", str(DEMO), "--set", "model.lora={rank: 8}", "--set",
                             "trainer.backend=megatron"), "model.lora", "megatron")


@pytest.mark.parametrize(("engine", "lora", "needle"), [
    ("vllm", "{rank: 8, modules_to_save: [lm_head]}", "modules_to_save"),
    ("sglang", "{rank: 8, modules_to_save: [lm_head]}", "modules_to_save"),
    ("vllm", "{rank: 600}", "up to 512")])
def test_lora_a_server_cannot_serve_is_refused_in_one_line(engine: str, lora: str, needle: str) -> None:
    assert_one_error(run_cli("validate", str(DEMO), "--set", f"model.lora={lora}", "--set",
                             f"rollout.engine={engine}"), "model.lora", needle)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_lora_with_a_server_engine_passes(engine: str) -> None:
    res = run_cli("validate", str(DEMO), "--set", "model.lora={rank: 8}", "--set", f"rollout.engine={engine}")
    assert res.rc == 0, res.err


def test_a_valid_lora_section_passes() -> None:
    res = run_cli("validate", str(DEMO), "--set", "model.lora={rank: 8, modules_to_save: [lm_head]}",
                  "--executor", "local")
    assert res.rc == 0, res.err


def test_a_target_the_model_lacks_is_one_user_error() -> None:
    from relax_hpc.errors import UserError

    cfg = make_cfg(model={"lora": {"rank": 4, "target_modules": ["q_proj", "nosuch"]}})
    with pytest.raises(UserError, match="no module 'nosuch'") as exc:
        _backend(cfg)
    assert "\n" not in str(exc.value)


# ------------------------------------------------------------------------------------------------- training
def test_only_the_adapter_is_trained() -> None:
    cfg = make_cfg(model=LORA, trainer={"lr": 1e-2})
    backend, _ = _backend(cfg)
    trained = {n for n, p in backend.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    before = {n: p.detach().clone() for n, p in backend.model.named_parameters()}
    _train_steps(backend)
    after = dict(backend.model.named_parameters())
    for n, p in before.items():
        if n in trained and "lora_B" in n:
            assert not torch.equal(p, after[n]), f"{n} did not move"
        elif n not in trained:
            assert torch.equal(p, after[n]), f"frozen {n} changed"
    n_opt = sum(len(g["params"]) for g in backend.optimizer.param_groups)
    assert n_opt == len(trained)


def test_checkpoint_holds_the_adapter_and_its_optimizer_state_and_resumes(tmp_path: Path) -> None:
    from relax_hpc.rundir import RunDir
    from relax_hpc.trainer.checkpoint import load_checkpoint, save_checkpoint

    cfg = make_cfg(model=LORA, trainer={"lr": 1e-2})
    a, _ = _backend(cfg)
    _train_steps(a)
    model_sd, optim_sd = a.checkpoint_state()
    assert model_sd and all("lora_" in k for k in model_sd)
    path = save_checkpoint(RunDir.create(tmp_path / "run"), a.step, model_sd=model_sd, optim_sd=optim_sd,
                           state={"step": a.step})
    assert (path / "model.safetensors").stat().st_size < 64 << 10  # the adapter, not the model
    model_sd, optim_sd, _ = load_checkpoint(path)
    b, _ = _backend(cfg)
    b.load_checkpoint_state(model_sd, optim_sd)
    for (n, p), (m, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert n == m and torch.equal(p, q), n
    # the next step is the same on both: the optimizer state came back too
    _train_steps(a, 1)
    _train_steps(b, 1)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), n


def test_a_checkpoint_of_another_adapter_is_one_user_error() -> None:
    from relax_hpc.errors import UserError

    a, _ = _backend(make_cfg(model=LORA))
    b, _ = _backend(make_cfg(model={"lora": {"rank": 4, "target_modules": ["q_proj"]}}))
    with pytest.raises(UserError, match=r"does not fit model\.lora"):
        b.load_checkpoint_state(*a.checkpoint_state())


# ------------------------------------------------------------------------------------------------- snapshots
@pytest.fixture
def published(tmp_path: Path):
    """A trained adapter (a few steps) published as snapshot v1; (cfg, backend, folder)."""
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights.publisher import SnapshotPublisher

    cfg = make_cfg(model=LORA, trainer={"lr": 1e-2})
    backend, _ = _backend(cfg)
    _train_steps(backend, 3)
    folder = SnapshotPublisher(RunDir.create(tmp_path / "run")).publish(
        backend.full_state_dict(copy=True), version=1, step=1, model_config=backend.hf_config(),
        adapter=backend.adapter_config())
    return cfg, backend, folder


def test_adapter_snapshot_loads_in_peft_and_names_its_base(published) -> None:
    from peft import PeftModel

    from relax_hpc.models.lora import base_identity

    cfg, backend, folder = published
    names = sorted(p.name for p in folder.iterdir())
    assert "adapter_model.safetensors" in names and "adapter_config.json" in names
    assert not any(n.startswith("model") and n.endswith(".safetensors") for n in names), names
    manifest = json.loads((folder / "manifest.json").read_text())
    base = _fresh_base(cfg)
    assert manifest["adapter"]["base"] == base_identity(base, "tiny")
    ids = torch.randint(3, base.config.vocab_size, (2, 9))
    loaded = PeftModel.from_pretrained(base, str(folder))
    want = _logits(backend.model, ids)
    assert not torch.allclose(want, _logits(_fresh_base(cfg), ids), atol=1e-4)  # the adapter changes the model
    assert torch.allclose(_logits(loaded, ids), want, atol=1e-5)


def test_the_hf_engine_merges_an_adapter_snapshot(published) -> None:
    from relax_hpc.rollout.engine import SnapshotFolder
    from relax_hpc.rollout.hf_engine import from_config

    cfg, backend, folder = published
    from relax_hpc.models.load import load_tokenizer

    engine = from_config(cfg, device="cpu", seed=0, tokenizer=load_tokenizer(cfg.model))
    try:
        asyncio.run(engine.receive(1, SnapshotFolder(folder)))
        assert engine.version == 1
        ids = torch.randint(3, engine.model.config.vocab_size, (2, 9))
        assert torch.allclose(_logits(engine.model, ids), _logits(backend.model, ids), atol=1e-5)
    finally:
        engine.shutdown()


def test_an_engine_without_lora_refuses_an_adapter_snapshot(published) -> None:
    from relax_hpc.errors import SnapshotError
    from relax_hpc.models.load import load_tokenizer
    from relax_hpc.rollout.engine import SnapshotFolder
    from relax_hpc.rollout.hf_engine import from_config

    _, _, folder = published
    plain = make_cfg()
    engine = from_config(plain, device="cpu", seed=0, tokenizer=load_tokenizer(plain.model))
    try:
        with pytest.raises(SnapshotError, match=r"without model\.lora"):
            asyncio.run(engine.receive(1, SnapshotFolder(folder)))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("save", [[], ["lm_head"]])
def test_fast_path_buffers_match_the_adapter(save: list[str]) -> None:
    from relax_hpc.models.lora import adapter_template

    cfg = make_cfg(model={"lora": {"rank": 4, "modules_to_save": save}, "tiny": {"tie_embeddings": False}})
    backend, _ = _backend(cfg)
    state = backend.full_state_dict()
    tpl = adapter_template(_fresh_base(cfg), cfg.model.lora)
    assert sorted(state) == sorted(tpl)
    assert all(state[k].shape == tpl[k].shape for k in state)


def test_a_lora_policy_takes_the_chunked_head_and_matches_full_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A LoRA policy's log-probs through the chunked head (the path of real vocabularies: SmolLM2's 49k tokens took
    it, and the PEFT wrapper's ``.model`` is the whole causal LM, whose output has no ``last_hidden_state``): they
    run through the module PEFT wraps, adapters included, and equal the full-logits path."""
    from relax_hpc.trainer import logprobs as L
    from relax_hpc.trainer.batch import build_micro_batch

    cfg = make_cfg(model=LORA, trainer={"lr": 1e-2})
    backend, _ = _backend(cfg)
    _train_steps(backend)  # lora_B away from zero: the adapters change the log-probs
    assert not L.model_supported(backend.model)  # the PEFT wrapper itself is never taken for a plain causal LM
    mb = build_micro_batch(make_items(seed=5))
    monkeypatch.setattr(L, "SMALL_LOGITS", 0)
    assert L.chunked_supported(backend.generation_model(), mb)
    with torch.no_grad():
        chunked, _ = backend.sequence_logprobs(backend.model, mb)
        monkeypatch.setattr(L, "SMALL_LOGITS", 1 << 62)
        full, _ = backend.sequence_logprobs(backend.model, mb)
        with backend.model.disable_adapter():
            base, _ = backend.sequence_logprobs(backend.model, mb)
    assert torch.allclose(chunked, full, atol=1e-5)
    assert not torch.allclose(full, base, atol=1e-4)  # the adapters are in both


def test_on_a_bf16_base_the_adapters_stay_float32_but_keep_no_float32_copy_of_the_input() -> None:
    """PEFT's own path casts each adapted layer's input to the adapters' float32 and autograd saves that copy (34 %
    more saved activations than full fine-tuning at the Qwen3-4B shape); relax-hpc's adapters compute in the
    input's dtype instead: float32 parameters and gradients, fewer activation bytes saved than full fine-tuning
    (which saves each input once, as the adapters now share it), and the same gradients as PEFT's path to bf16
    precision."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from relax_hpc.config.schema import LoraConfig
    from relax_hpc.models.lora import apply_lora

    cfg = Qwen3Config(vocab_size=128, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))

    def run(how: str) -> tuple[dict[str, torch.Tensor], int]:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        if how == "ours":
            model = apply_lora(model, LoraConfig(rank=8, alpha=16))
        elif how == "peft":
            model = get_peft_model(model, PeftLoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                                                         target_modules=list(LoraConfig().target_modules)))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero: give it values so that A's gradient is not zero
                torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(len(name)))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad and "lora" in n}
        assert how == "full" or all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora" in n)
        return grads, sum(saved.values())

    _, full = run("full")
    theirs, peft_bytes = run("peft")
    ours, our_bytes = run("ours")
    assert our_bytes < full < peft_bytes, (our_bytes, full, peft_bytes)
    assert ours.keys() == theirs.keys() and ours
    for name, g in ours.items():
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, theirs[name], rtol=0.05, atol=0.02 * float(theirs[name].abs().max()))
