"""Load a user object named ``module:attr`` or ``path/to/file.py:attr`` (reward functions, environments, tools,
tool-call parsers). One clear ``ValueError`` line for a name that does not resolve."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def load_object(target: str, kind: str) -> Any:
    """The object ``target`` names; ``kind`` ("environment", "tool" ...) words the error."""
    mod, _, attr = target.rpartition(":")
    if not mod or not attr:
        raise ValueError(f"{kind} {target!r} is not of the form module:name or path/to/file.py:name")
    try:
        module = import_user_module(mod, kind)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"cannot import {kind} {target!r}: {type(exc).__name__}: {exc}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise ValueError(f"{kind} {target!r}: {mod} has no attribute {attr!r}")
    return obj


def import_user_module(mod: str, kind: str) -> Any:
    """The module ``mod`` (a dotted name, or a ``path.py`` through :func:`import_file`). A module that calls
    ``sys.exit()`` (or raises SystemExit) while it is imported is one ``ValueError``, not the end of the caller."""
    try:
        return import_file(mod, kind) if mod.endswith(".py") else importlib.import_module(mod)
    except SystemExit as exc:
        raise ValueError(f"{kind} module {mod} called sys.exit({exc.code!r}) while it was imported") from None


def import_file(mod: str, kind: str) -> Any:
    """The module of a user file ``mod`` (``path.py``), imported once per path; a file that failed to import can be
    imported again once fixed. Import errors propagate; a missing file is one ``ValueError``."""
    path = Path(mod).expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{kind} file {path} does not exist")
    name = f"relax_hpc_user_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]  # a fixed file must be importable again
            raise
    return module
