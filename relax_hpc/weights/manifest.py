"""The snapshot manifest, the LATEST pointer and the list of published versions.

``weights/vNNNNNN/manifest.json``::

    {"format": "relax-hpc-weights", "protocol": 1, "version": 12, "step": 340, "time": 1.7e9,
     "dtype": "BF16", "dtypes": ["BF16", "F32"], "world_size": 1, "total_bytes": 123,
     "files": [{"name": "model-00001-of-00002.safetensors", "bytes": 123, "sha256": "<hex>", "tensors": ["k", ...]}],
     "tensors": {"model.embed.weight": {"dtype": "BF16", "shape": [V, H],
                                        "pieces": [{"file": "model-00001-of-00002.safetensors", "key": "..."}]}},
     "model_config": {...}, "extra": {...}}

A tensor stored whole has one piece whose key is its own name. A tensor published in shards by several ranks has
one piece per shard with ``dim`` and ``offset``: the shard is the slice ``offset:offset+len`` of the full tensor along
``dim``. ``weights/LATEST`` is ``{"version", "name", "step", "time"}``, rewritten atomically after the folder is in
place, so it always names a complete snapshot.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from relax_hpc.errors import SnapshotError
from relax_hpc.fsio import atomic_write_json, is_complete, read_json
from relax_hpc.rundir import RunDir

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "relax-hpc-weights"
PROTOCOL = 1
_VERSION_RE = re.compile(r"^v(\d{6,})$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def version_of(name: str) -> int | None:
    """The version a snapshot folder name stands for (``v000012`` -> 12), None for other names."""
    m = _VERSION_RE.match(name)
    return int(m.group(1)) if m else None


def complete_versions(rd: RunDir) -> list[int]:
    """Every version with a complete snapshot folder, ascending (one directory listing plus a stat per folder)."""
    try:
        names = [p.name for p in rd.weights.iterdir()]
    except FileNotFoundError:
        return []
    versions = [v for v in (version_of(n) for n in names) if v is not None]
    return sorted(v for v in versions if is_complete(rd.snapshot(v)))


def read_latest(rd: RunDir) -> dict[str, Any] | None:
    """The LATEST record (one small read), or None if nothing was published yet."""
    try:
        rec = read_json(rd.weights_latest)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"cannot read {rd.weights_latest}: {exc}") from exc
    if not isinstance(rec, dict) or not isinstance(rec.get("version"), int):
        raise SnapshotError(f"{rd.weights_latest} does not name a version: {rec!r}")
    return rec


def latest_version(run_dir: RunDir | Path | str) -> int | None:
    """The newest complete snapshot's version, from one small read of ``weights/LATEST`` (None if none yet)."""
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    try:
        rec = read_latest(rd)
    except SnapshotError as exc:  # a damaged LATEST: the folders on disk are the truth (newest complete one)
        versions = complete_versions(rd)
        log.warning("%s; using the newest complete snapshot on disk (%s)", exc, versions[-1] if versions else None)
        return versions[-1] if versions else None
    return None if rec is None else int(rec["version"])


def write_latest(rd: RunDir, version: int, step: int, time_s: float) -> None:
    """Point LATEST at ``version`` (atomic small-file replace)."""
    atomic_write_json(rd.weights_latest, {"version": version, "name": rd.snapshot(version).name, "step": step,
                                          "time": time_s}, indent=None)


def _fail(path: Path, key: str, problem: str) -> SnapshotError:
    return SnapshotError(f"{path}: {key} {problem}")


def _plain_name(path: Path, key: str, value: Any) -> str:
    if not isinstance(value, str) or not value or "/" in value or "\\" in value or value.startswith("."):
        raise _fail(path, key, f"must be a plain file name, got {value!r}")
    return value


def validate_manifest(path: Path, m: Any) -> dict[str, Any]:
    """Check a manifest's structure; :class:`SnapshotError` naming the file and the key otherwise."""
    if not isinstance(m, dict):
        raise _fail(path, "the manifest", "is not a JSON object")
    if m.get("format") != FORMAT:
        raise _fail(path, "'format'", f"must be {FORMAT!r}, got {m.get('format')!r}")
    for key in ("version", "step"):
        if not isinstance(m.get(key), int):
            raise _fail(path, repr(key), f"must be an integer, got {m.get(key)!r}")
    files = m.get("files")
    if not isinstance(files, list) or not files:
        raise _fail(path, "'files'", "must be a non-empty list")
    names = set()
    for i, f in enumerate(files):
        if not isinstance(f, dict):
            raise _fail(path, f"files[{i}]", "must be an object")
        names.add(_plain_name(path, f"files[{i}].name", f.get("name")))
        if not isinstance(f.get("bytes"), int) or f["bytes"] < 0:
            raise _fail(path, f"files[{i}].bytes", f"must be a size in bytes, got {f.get('bytes')!r}")
        if not isinstance(f.get("sha256"), str) or not _HEX64.match(f["sha256"]):
            raise _fail(path, f"files[{i}].sha256", f"must be 64 hex digits, got {f.get('sha256')!r}")
    tensors = m.get("tensors")
    if not isinstance(tensors, dict):
        raise _fail(path, "'tensors'", "must be an object")
    for name, t in tensors.items():
        key = f"tensors[{name!r}]"
        if not isinstance(t, dict) or not isinstance(t.get("dtype"), str) or not isinstance(t.get("shape"), list):
            raise _fail(path, key, "must have 'dtype' and 'shape'")
        pieces = t.get("pieces")
        if not isinstance(pieces, list) or not pieces:
            raise _fail(path, f"{key}.pieces", "must be a non-empty list")
        for j, p in enumerate(pieces):
            if not isinstance(p, dict) or p.get("file") not in names or not isinstance(p.get("key"), str):
                raise _fail(path, f"{key}.pieces[{j}]", "must name a listed file and a key")
    return m


def read_manifest(folder: Path) -> dict[str, Any]:
    """Read and validate ``folder/manifest.json``."""
    path = folder / MANIFEST
    try:
        m = read_json(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise SnapshotError(f"cannot read {path}: {exc}") from exc
    return validate_manifest(path, m)


def check_pieces(name: str, entry: dict[str, Any]) -> None:
    """Check that the shards of one tensor tile it exactly along one dim (raised before anything is published)."""
    shape = entry["shape"]
    pieces = entry["pieces"]
    if len(pieces) == 1 and "dim" not in pieces[0]:
        return
    dims = {p.get("dim") for p in pieces}
    if len(dims) != 1 or None in dims:
        raise SnapshotError(f"tensor {name!r}: shards must all split the same dim, got dims {sorted(map(str, dims))}")
    dim = dims.pop()
    if not 0 <= dim < len(shape):
        raise SnapshotError(f"tensor {name!r}: shard dim {dim} out of range for shape {shape}")
    pos = 0
    for p in sorted(pieces, key=lambda p: p["offset"]):
        if p["offset"] != pos:
            raise SnapshotError(f"tensor {name!r}: shards along dim {dim} leave a gap or overlap at {pos} "
                                f"(next shard starts at {p['offset']})")
        other = [s for i, s in enumerate(p["shape"]) if i != dim]
        if other != [s for i, s in enumerate(shape) if i != dim]:
            raise SnapshotError(f"tensor {name!r}: shard shape {p['shape']} does not fit full shape {shape}")
        pos += p["shape"][dim]
    if pos != shape[dim]:
        raise SnapshotError(f"tensor {name!r}: shards cover {pos} of {shape[dim]} along dim {dim}")
