"""``relax-hpc export RUN_DIR [--merge]``: a LoRA run's snapshot as its PEFT adapter folder, or merged into the base
model (an HF folder transformers loads without PEFT, giving the PEFT model's logits); a full run's snapshot as an HF
folder; bad requests as one error line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.backend_conformance import make_cfg, make_items
from tests.helpers.badinput import assert_one_error, run_cli

LORA = {"lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}}


def _run(tmp_path: Path, model: dict) -> tuple[object, Path]:
    """A run dir whose config.json is a tiny recipe (``model`` fields) with one trained snapshot v2; (cfg, root)."""
    from relax_hpc.algorithms import registry
    from relax_hpc.config.load import config_to_json
    from relax_hpc.models.load import load_model, load_tokenizer
    from relax_hpc.rundir import RunDir
    from relax_hpc.trainer.backend import make_backend
    from relax_hpc.weights.publisher import SnapshotPublisher

    cfg = make_cfg(model=model, trainer={"lr": 2e-2})
    tok = load_tokenizer(cfg.model)
    backend = make_backend(cfg, rank=0, world_size=1, device="cpu", dtype=torch.float32,
                           algorithm=registry.get_algorithm(cfg.algorithm.name), tokenizer=tok,
                           model=load_model(cfg.model, tok, device="cpu", dtype=torch.float32))
    for k in range(2):
        backend.begin_step()
        backend.accumulate(make_items(seed=k))
        backend.finish_step()
    rd = RunDir.create(tmp_path / "run")
    rd.config.write_text(json.dumps(config_to_json(cfg)))
    SnapshotPublisher(rd).publish(backend.full_state_dict(copy=True), version=2, step=2,
                                  model_config=backend.hf_config(), adapter=backend.adapter_config())
    return cfg, rd.root


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


def _base(cfg):
    from relax_hpc.models.load import load_model, load_tokenizer

    return load_model(cfg.model, load_tokenizer(cfg.model), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory):
    return _run(tmp_path_factory.mktemp("lora"), LORA)


def test_merge_writes_an_hf_folder_with_the_peft_models_logits(lora_run) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg, root = lora_run
    res = run_cli("export", str(root), "--merge")
    assert res.rc == 0, res.err
    out = root / "exports" / "v000002-merged"
    assert str(out) in res.out and not list(out.glob("adapter_*")), sorted(p.name for p in out.iterdir())
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    peft = PeftModel.from_pretrained(_base(cfg), str(root / "weights" / "v000002"))
    ids = torch.randint(3, merged.config.vocab_size, (2, 11))
    want = _logits(peft, ids)
    assert not torch.allclose(want, _logits(_base(cfg), ids), atol=1e-4)  # the adapter changed the model
    assert torch.allclose(_logits(merged, ids), want, atol=1e-5)
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer_config.json").is_file()


def test_without_merge_the_adapter_folder_loads_in_peft(lora_run) -> None:
    from peft import PeftModel

    cfg, root = lora_run
    out = root.parent / "adapter"
    res = run_cli("export", str(root), "--version", "2", "--out", str(out))
    assert res.rc == 0, res.err
    assert {"adapter_model.safetensors", "adapter_config.json"} <= {p.name for p in out.iterdir()}
    assert not list(out.glob("model*.safetensors"))
    base = _base(cfg)
    ids = torch.randint(3, base.config.vocab_size, (2, 7))
    got = _logits(PeftModel.from_pretrained(base, str(out)), ids)
    assert torch.allclose(got, _logits(PeftModel.from_pretrained(_base(cfg), str(root / "weights" / "v000002")), ids))


def test_bad_exports_are_one_line(lora_run, tmp_path: Path) -> None:
    _, root = lora_run
    assert_one_error(run_cli("export", str(root), "--version", "7"), "no complete snapshot v7")
    assert_one_error(run_cli("export", str(root), "--out", str(root / "weights")), "exists")
    # a base other than the adapter's (another init seed): refused, naming the mismatch
    orig = (root / "config.json").read_text()
    other = json.loads(orig)
    other["model"]["init_seed"] = 5
    try:
        (root / "config.json").write_text(json.dumps(other))
        res = run_cli("export", str(root), "--merge", "--out", str(tmp_path / "m"))
        assert_one_error(res, "not the adapter's base")
        assert not (tmp_path / "m").exists()
    finally:
        (root / "config.json").write_text(orig)


def test_a_full_run_exports_its_weights_and_refuses_merge(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from relax_hpc.weights.reader import load_snapshot

    _, root = _run(tmp_path, {})
    assert_one_error(run_cli("export", str(root), "--merge"), "nothing to merge")
    res = run_cli("export", str(root))
    assert res.rc == 0, res.err
    model = AutoModelForCausalLM.from_pretrained(root / "exports" / "v000002", dtype=torch.float32)
    state, _ = load_snapshot(root / "weights" / "v000002")
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in state.items())
