"""The algorithm registry: name -> module. Importing this file imports no torch.

A new algorithm is one small module under ``relax_hpc/algorithms/`` exposing an ``ALGORITHM`` object (see
``base.py``) plus one line here, or a user module named in the recipe as ``module:attr``.
"""

from __future__ import annotations

import importlib
from typing import Any

from relax_hpc.errors import ConfigError

BUILTIN: dict[str, str] = {
    "grpo": "relax_hpc.algorithms.grpo:ALGORITHM",
    "gspo": "relax_hpc.algorithms.gspo:ALGORITHM",
    "sapo": "relax_hpc.algorithms.sapo:ALGORITHM",
    "distill": "relax_hpc.algorithms.distill:ALGORITHM",
}

REQUIRED_METHODS = ("sequence_advantages", "loss")
"""What an algorithm object must have (the protocol in ``base.py``)."""


def _resolve(name: str) -> Any:
    """Import the algorithm object for ``name``; ValueError with one clear line if that fails."""
    target = BUILTIN.get(name, name)
    mod, sep, attr = target.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"unknown algorithm {name!r}; registered: {', '.join(sorted(BUILTIN))} (or module:attr)")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except Exception as exc:  # any import problem of user code is a config problem
        raise ValueError(f"cannot import algorithm {name!r}: {type(exc).__name__}: {exc}") from None
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(obj, m, None))]
    if missing:
        raise ValueError(f"algorithm {name!r} has no {' / '.join(f'{m}()' for m in missing)} method")
    return obj


def check_algorithm_name(name: str) -> None:
    """Raise ValueError (-> a config problem) unless ``name`` is registered or an importable ``module:attr``.

    Built-in names are not imported here (that would import torch); user ones are imported and checked now.
    """
    if name not in BUILTIN:
        _resolve(name)


def get_algorithm(name: str) -> Any:
    """The algorithm object for ``name`` (imports torch). Raises :class:`ConfigError` if it cannot be loaded."""
    try:
        return _resolve(name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
