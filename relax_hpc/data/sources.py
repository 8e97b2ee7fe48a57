"""Read prompt rows from local files: JSONL, JSON, Parquet, a folder of them, or a folder saved by HF ``datasets``.

Plain files are read directly (stdlib ``json``; ``pyarrow`` for Parquet), so that a bad line is reported as
``file:line`` and nothing is cached anywhere. A folder written by ``datasets.Dataset.save_to_disk`` is read with HF
``datasets`` (an optional dependency). A folder of files is read in sorted name order, not recursively.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.errors import UserError

SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Row:
    """One record and where it came from (for error messages and relative media paths)."""

    fields: dict[str, Any]
    origin: str
    """``file.jsonl:12`` (line) or ``file.parquet#12`` (row index)."""
    base_dir: Path | None
    """Folder that relative media paths in the row are resolved against (None for generated rows)."""


def _read_jsonl(path: Path) -> list[Row]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise UserError(f"{path}:{lineno}: a row must be a JSON object, got {type(obj).__name__}")
            rows.append(Row(obj, f"{path}:{lineno}", path.parent))
    return rows


def _read_json(path: Path) -> list[Row]:
    text = path.read_text(encoding="utf-8")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return _read_jsonl(path)  # JSON lines in a .json file
    if isinstance(obj, dict):
        obj = [obj]
    if not isinstance(obj, list):
        raise UserError(f"{path}: expected a JSON array of objects, got {type(obj).__name__}")
    for i, item in enumerate(obj):
        if not isinstance(item, dict):
            raise UserError(f"{path}#{i}: a row must be a JSON object, got {type(item).__name__}")
    return [Row(item, f"{path}#{i}", path.parent) for i, item in enumerate(obj)]


def _read_parquet(path: Path) -> list[Row]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise UserError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    return [Row(rec, f"{path}#{i}", path.parent) for i, rec in enumerate(table.to_pylist())]


def _read_saved_dataset(folder: Path) -> list[Row]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"{folder} was saved by HF datasets; reading it needs it: pip install datasets") from None
    try:
        ds = datasets.load_from_disk(str(folder))
    except Exception as exc:
        raise UserError(f"{folder}: cannot load the saved dataset ({type(exc).__name__}: {exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise UserError(f"{folder} holds splits {sorted(ds)} and none is called 'train'; point at one split")
        ds = ds["train"]
    return [Row(rec, f"{folder}#{i}", folder) for i, rec in enumerate(ds)]


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}


def read_rows(path: str | Path, *, where: str = "data.path") -> list[Row]:
    """Every row of the file or folder at ``path``. Raises :class:`UserError` naming ``where`` and the file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"{where}: {p} does not exist")
    if p.is_dir():
        if (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file():
            return _read_saved_dataset(p)
        files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in SUFFIXES)
        if not files:
            raise UserError(f"{where}: folder {p} holds no {'/'.join(SUFFIXES)} files")
        return [row for f in files for row in _READERS[f.suffix](f)]
    reader = _READERS.get(p.suffix)
    if reader is None:
        raise UserError(f"{where}: {p} is not a {'/'.join(SUFFIXES)} file")
    return reader(p)
