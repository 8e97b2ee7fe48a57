"""Writing any snapshot version (full or delta) as a plain HF model folder.

A server engine (vLLM, SGLang) reloads weights from a folder of safetensors files; a delta version has only
``delta.bin``. The rollout worker driving such a server materialises the version into a folder of its own (on
node-local disk when it has one) and points the server there (:func:`full_folder`, called by the server engines'
``_loadable``); a user can call :func:`materialise` to get any version as a model folder.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from relax_hpc.fsio import atomic_write_json, is_complete, staged_dir
from relax_hpc.weights.format import HashPipeline, write_file
from relax_hpc.weights.manifest import MANIFEST, read_manifest
from relax_hpc.weights.publisher import write_hf_files
from relax_hpc.weights.reader import Verify, load_snapshot


def materialise(folder: Path, dest: Path, *, verify: Verify = "sha256") -> Path:
    """Write the version in snapshot ``folder`` (delta or full) as a complete snapshot and HF model folder ``dest``
    (which must not exist yet): one ``model.safetensors``, ``config.json``, ``generation_config.json``, a full
    manifest and ``COMPLETE``. Returns ``dest``."""
    state, manifest = load_snapshot(folder, verify=verify)
    with staged_dir(dest, marker_content=str(manifest["version"])) as tmp, HashPipeline(0) as hasher:
        nbytes, stream = write_file(tmp / "model.safetensors", list(state.items()), hasher, {"format": "pt"})
        sha = hasher.finish()[stream]
        full = {**manifest, "delta": None, "total_bytes": nbytes,
                "files": [{"name": "model.safetensors", "bytes": nbytes, "sha256": sha, "tensors": list(state)}],
                "tensors": {k: {"dtype": v["dtype"], "shape": v["shape"],
                                "pieces": [{"file": "model.safetensors", "key": k}]}
                            for k, v in manifest["tensors"].items()}}
        full["hf_files"] = write_hf_files(tmp, full)
        atomic_write_json(tmp / MANIFEST, full, fsync=False, indent=None)
    read_manifest(dest)
    return dest


def full_folder(folder: Path, root: Path, *, keep: int = 2) -> Path:
    """``folder`` itself unless it is a delta snapshot; a delta is materialised once into ``root/<folder name>`` (a
    full snapshot and HF folder, verified) and that folder returned. Older materialised folders go (``keep`` stay)."""
    try:
        delta = json.loads((folder / MANIFEST).read_text()).get("delta")
    except (OSError, ValueError):
        return folder  # not a snapshot (a plain HF folder): nothing to materialise
    if not isinstance(delta, dict) or delta.get("base") is None:
        return folder
    dest = root / folder.name
    if not is_complete(dest):
        shutil.rmtree(dest, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        materialise(folder, dest)
    for old in sorted(p for p in root.iterdir() if p.name != dest.name and not p.name.startswith("."))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return dest
