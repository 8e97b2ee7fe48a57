"""The reward registry: built-in names and user functions (``module:function`` or ``path/file.py:function``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

BUILTIN: dict[str, str] = {
    "exact_match": "relax_hpc.rewards.builtin:exact_match",
    "math": "relax_hpc.rewards.builtin:math_answer",
    "math_answer": "relax_hpc.rewards.builtin:math_answer",
    "format": "relax_hpc.rewards.builtin:format_check",
    "format_check": "relax_hpc.rewards.builtin:format_check",
    "digits_positional": "relax_hpc.rewards.builtin:digits_positional",
    "last_number": "relax_hpc.rewards.builtin:last_number",
    "multiple_choice": "relax_hpc.rewards.multimodal:multiple_choice",
    "boxed_answer": "relax_hpc.rewards.multimodal:boxed_answer",
}


def _load(target: str) -> Callable[..., Any]:
    mod, _, attr = target.rpartition(":")
    if not mod or not attr:
        raise ValueError(f"reward {target!r} is neither built-in ({', '.join(sorted(BUILTIN))}) nor module:function")
    from relax_hpc.plugins import import_user_module

    module = import_user_module(mod, "reward")
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward {target!r}: {mod} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward {target!r} is not callable (it is a {type(fn).__name__})")
    return fn


def resolve_reward(name: str) -> Callable[..., Any]:
    """The reward callable for ``name`` (a built-in name, ``module:function`` or ``path/file.py:function``)."""
    return _load(BUILTIN.get(name, name))


def check_reward(name: str, kwargs: dict[str, Any] | None = None) -> None:
    """Import and check the reward now (at validation), not mid-run. Raises ValueError with one clear line.

    With ``kwargs``, also checks that the function accepts them (``fn(response, answer, **kwargs)``).
    """
    from relax_hpc.rewards.api import check_signature

    try:
        fn = resolve_reward(name)
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"cannot import reward {name!r}: {type(exc).__name__}: {exc}") from None
    if kwargs is not None:
        try:
            check_signature(fn, kwargs)
        except TypeError as exc:
            raise ValueError(f"reward {name!r} cannot be called with reward.kwargs {sorted(kwargs)}: {exc}") from None
