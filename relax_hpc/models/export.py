"""A run's weight snapshot as an HF model folder (``relax-hpc export RUN_DIR``).

A full snapshot is loaded into the base model rebuilt from the run's recipe and saved. An adapter snapshot
(``model.lora``) is copied as the PEFT adapter folder it is, or with ``merge`` merged into its base: the base
rebuilt from ``model.path`` must be the one the adapter names (the manifest's ``adapter.base.sha256``), then
``W = W0 + (alpha / rank) * B @ A`` for every adapted layer (PEFT's ``merge_and_unload``), ``modules_to_save``
taken as trained. The folder loads with ``AutoModelForCausalLM.from_pretrained`` and needs no PEFT.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.errors import UserError
from relax_hpc.fsio import TMP_PREFIX

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
"""The PEFT files of an adapter snapshot (weights/publisher.py writes them)."""


def export_snapshot(cfg: RecipeConfig, folder: Path, out: Path, *, merge: bool) -> str:
    """Write snapshot ``folder`` of a run with recipe ``cfg`` to ``out`` (staged beside it, then renamed; ``out``
    must not exist). Returns what was written, in a few words."""
    import torch

    from relax_hpc.models.load import load_model, load_tokenizer
    from relax_hpc.weights.reader import copy_state_into, load_snapshot

    if out.exists():
        raise UserError(f"{out} exists; give another --out or remove it")
    state, manifest = load_snapshot(folder)  # every file checked against the manifest's sha256
    adapter = manifest.get("adapter")
    if merge and not adapter:
        raise UserError(f"{folder} holds full weights (the run has no model.lora): nothing to merge; export "
                        "without --merge")
    stage = out.parent / f"{TMP_PREFIX}{out.name}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    tokenizer = load_tokenizer(cfg.model)
    if adapter and not merge:
        for name in ADAPTER_FILES:
            shutil.copyfile(folder / name, stage / name)
        what = "the LoRA adapter (PEFT folder)"
    else:
        base = load_model(cfg.model, tokenizer, device="cpu", dtype=torch.float32)
        if adapter:
            model = merged(base, folder, adapter["base"], cfg.model.path)
            what = "the base with the LoRA adapter merged"
        else:
            copy_state_into(base, state)
            model, what = base, "the full model"
        model.save_pretrained(stage, safe_serialization=True)
    tokenizer.save_pretrained(stage)
    stage.rename(out)
    return what


def merged(base: Any, folder: Path, named: dict[str, str], path: str) -> Any:
    """``base`` with the adapter of ``folder`` merged in (a plain HF module); ``named``: the manifest's
    ``adapter.base`` (path, sha256), checked against ``base``."""
    from peft import PeftModel

    from relax_hpc.models.lora import base_identity

    got = base_identity(base, path)["sha256"]
    if got != named.get("sha256"):
        raise UserError(f"model.path {path!r} is not the adapter's base: its weights' sha256 {got[:12]}... differs "
                        f"from the manifest's {str(named.get('sha256'))[:12]}... (base {named.get('path')!r})")
    return PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
