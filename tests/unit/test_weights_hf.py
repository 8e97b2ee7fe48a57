"""Every complete snapshot published with a model config is an HF model folder: ``from_pretrained(snapshot_dir)``
gives the trained model's logits, with one file, several files (index) and parts from several ranks."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax_hpc.fsio import read_json
from relax_hpc.rundir import RunDir
from relax_hpc.weights import SnapshotPublisher, SnapshotReader
from relax_hpc.weights.manifest import read_manifest
from relax_hpc.weights.publisher import HF_INDEX
from tests.helpers.tinymodel import IDS
from tests.helpers.tinymodel import tiny_demo_model as tiny


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def check_hf_folder(folder: Path, model) -> dict:
    manifest = read_manifest(folder)
    names = {e["name"] for e in manifest["hf_files"]}
    assert {"config.json", "generation_config.json"} <= names
    for e in manifest["hf_files"]:  # beside the manifest, with their sha256
        data = (folder / e["name"]).read_bytes()
        assert len(data) == e["bytes"] and hashlib.sha256(data).hexdigest() == e["sha256"]
    assert read_json(folder / "generation_config.json")["eos_token_id"] == model.config.eos_token_id
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert torch.equal(logits(loaded), logits(model))
    return manifest


@pytest.mark.parametrize("max_file_bytes", [512 << 20, 40_000])
def test_snapshot_folder_loads_with_from_pretrained(tmp_path: Path, max_file_bytes: int) -> None:
    model = tiny()
    rd = RunDir.create(tmp_path / "run")
    pub = SnapshotPublisher(rd, max_file_bytes=max_file_bytes)
    folder = pub.publish(model.state_dict(), version=1, step=1, model_config=model.config.to_dict())
    manifest = check_hf_folder(folder, model)
    files = [f["name"] for f in manifest["files"]]
    if len(files) == 1:
        assert files == ["model.safetensors"] and not (folder / HF_INDEX).exists()
    else:
        index = json.loads((folder / HF_INDEX).read_text())
        assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
        assert index["weight_map"].keys() == model.state_dict().keys()
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                      for t in model.state_dict().values())
    # the package's own reader loads the same folder, verified
    state = SnapshotReader(rd, name="t").load(1).state_dict
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_parts_of_several_ranks_make_an_hf_folder(tmp_path: Path) -> None:
    model = tiny()
    sd = model.state_dict()
    names = sorted(sd)
    rd = RunDir.create(tmp_path / "run")
    pub = SnapshotPublisher(rd, max_file_bytes=60_000)
    parts = [{k: sd[k] for k in names[r::2]} for r in range(2)]
    pub.publish_part(parts[1], version=1, step=1, rank=1, world_size=2, token="t")
    folder = pub.publish_part(parts[0], version=1, step=1, rank=0, world_size=2, token="t",
                              model_config=model.config.to_dict())
    check_hf_folder(folder, model)
    assert (folder / HF_INDEX).exists()


def test_trainer_published_snapshot_is_an_hf_folder(tmp_path: Path) -> None:
    """The trainer role's background publisher writes config and generation config from the backend."""
    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.config.load import validate_dict
    from relax_hpc.events import EventLog
    from relax_hpc.trainer.backend import make_backend
    from relax_hpc.trainer.session import TrainerSession
    from relax_hpc.weights.transport.files import SnapshotFiles

    cfg = validate_dict({"data": {"task": {"name": "reverse_digits"}}, "model": {"path": "tiny"}})
    model = tiny()
    rd = RunDir.create(tmp_path / "run")
    backend = make_backend(cfg, rank=0, world_size=1, device="cpu", dtype=torch.float32,
                           algorithm=get_algorithm("grpo"), tokenizer=None, model=model)
    session = TrainerSession(rd, cfg, backend, None, EventLog(rd, "trainer", 0))
    files = SnapshotFiles(session)
    files.submit(3, backend.full_state_dict())
    files.close()
    check_hf_folder(rd.snapshot(3), model)
    session.close()


def test_reader_verifies_the_hf_files(tmp_path: Path) -> None:
    from relax_hpc.errors import SnapshotError

    model = tiny()
    rd = RunDir.create(tmp_path / "run")
    folder = SnapshotPublisher(rd).publish(model.state_dict(), version=1, step=1, model_config=model.config.to_dict())
    cfg = folder / "config.json"
    text = cfg.read_text()
    cfg.write_text(text.replace('"hidden_size": 64', '"hidden_size": 46'))  # same size, other content
    with pytest.raises(SnapshotError, match=r"config\.json: sha256 does not match"):
        SnapshotReader(rd, name="t").load(1)
    assert SnapshotReader(rd, name="t").load(1, verify="size").version == 1  # sizes only


@pytest.mark.parametrize("parts", [False, True], ids=["one-writer", "parts"])
def test_unchanged_hf_files_are_linked_from_the_previous_snapshot(tmp_path: Path, parts: bool) -> None:
    """A run publishes the same config every step: the next snapshot hard-links it instead of writing it again.
    A changed config is written afresh, and a pruned previous folder falls back to writing."""
    import shutil

    model = tiny()
    rd = RunDir.create(tmp_path / "run")
    pub = SnapshotPublisher(rd, keep_last=10)
    cfg = model.config.to_dict()

    def publish(version: int, config: dict) -> Path:
        if not parts:
            return pub.publish(model.state_dict(), version=version, step=version, model_config=config)
        return pub.publish_part(model.state_dict(), version=version, step=version, rank=0, world_size=1,
                                token="t", model_config=config)

    def inode(version: int, name: str) -> int:
        return (rd.snapshot(version) / name).stat().st_ino

    for v in (1, 2):
        publish(v, cfg)
    for name in ("config.json", "generation_config.json"):
        assert inode(2, name) == inode(1, name) and (rd.snapshot(2) / name).stat().st_nlink == 2
    check_hf_folder(rd.snapshot(2), model)

    publish(3, {**cfg, "architectures": ["Qwen3ForCausalLM"], "note": "changed"})  # config.json changes
    assert inode(3, "config.json") != inode(2, "config.json")
    assert inode(3, "generation_config.json") == inode(2, "generation_config.json")
    assert read_json(rd.snapshot(3) / "config.json")["note"] == "changed"

    shutil.rmtree(rd.snapshot(3))  # pruned meanwhile: nothing to link from
    folder = publish(4, cfg)
    assert inode(4, "config.json") != inode(2, "config.json")
    check_hf_folder(folder, model)

    cfg["extra_settings"] = {"a": 1}  # the remembered encoding of a config is keyed by its content, not its object
    publish(5, cfg)
    cfg["extra_settings"]["a"] = 2  # the same dict objects, changed in place
    publish(6, cfg)
    assert read_json(rd.snapshot(6) / "config.json")["extra_settings"] == {"a": 2}
    assert inode(6, "config.json") != inode(5, "config.json")
    assert inode(6, "generation_config.json") == inode(5, "generation_config.json")
