"""Environment names in recipes: built-in names or ``module:Class`` / ``path/to/file.py:Class``, resolved and
checked when the recipe is validated (a class that does not exist, lacks a method, does not take the recipe's
kwargs, or offers a tool without a JSON schema is one clear error line), never looked up mid-run."""

from __future__ import annotations

import inspect
from typing import Any

BUILTIN: dict[str, str] = {
    "calculator": "relax_hpc.envs.builtin.calculator:CalculatorEnv",
    "python_tool": "relax_hpc.envs.builtin.calculator:PythonToolEnv",
    "guess_number": "relax_hpc.envs.builtin.guessing:GuessNumberEnv",
    "digit_lookup": "relax_hpc.envs.builtin.lookup:DigitLookupEnv",
}


def resolve_env(name: str) -> type:
    """The environment class ``name`` names (ValueError with one line otherwise)."""
    from relax_hpc.plugins import load_object

    target = BUILTIN.get(name, name)
    if ":" not in target:
        raise ValueError(f"environment {name!r} is neither built-in ({', '.join(sorted(BUILTIN))}) "
                         "nor module:Class / path.py:Class")
    cls = load_object(target, "environment")
    if not isinstance(cls, type):
        raise ValueError(f"environment {name!r} is not a class (it is a {type(cls).__name__})")
    return cls


def check_env(name: str, kwargs: dict[str, Any]) -> None:
    """Import the class, check its methods and kwargs, build one instance and check its tools."""
    from relax_hpc.envs.api import REQUIRED_METHODS
    from relax_hpc.envs.tools import check_tool

    cls = resolve_env(name)
    for meth in REQUIRED_METHODS:
        fn = getattr(cls, meth, None)
        if fn is None or not callable(fn):
            raise ValueError(f"environment {name!r} ({cls.__name__}) has no method {meth}()")
        if not inspect.iscoroutinefunction(fn):
            raise ValueError(f"environment {name!r}: {cls.__name__}.{meth} must be `async def`")
        if getattr(fn, "__isabstractmethod__", False):
            raise ValueError(f"environment {name!r}: {cls.__name__}.{meth} is abstract (not implemented)")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise ValueError(f"environment {name!r} cannot be built with rollout.env.kwargs {sorted(kwargs)}: "
                         f"{exc}") from None
    env = make_env(name, kwargs)
    for fn in (env.tools() if callable(getattr(env, "tools", None)) else ()):
        check_tool(fn)


def check_warmup_hook(name: str) -> None:
    """The environment ``name`` has the supervised warm-up hook (``warmup.source: env``)."""
    from relax_hpc.envs.api import WARMUP_METHOD

    cls = resolve_env(name)
    if not callable(getattr(cls, WARMUP_METHOD, None)):
        raise ValueError(f"warmup.source: env: environment {name!r} ({cls.__name__}) has no method "
                         f"{WARMUP_METHOD}(task, rng) (set warmup.source: data, or warmup.steps: 0)")


def make_env(name: str, kwargs: dict[str, Any]) -> Any:
    """A fresh instance (one per episode). Constructors must be cheap and start nothing (that is ``reset``'s
    job): validation builds one to check its tools."""
    cls = resolve_env(name)
    try:
        return cls(**kwargs)
    except Exception as exc:
        raise ValueError(f"environment {name!r}: {cls.__name__}(**kwargs) raised {type(exc).__name__}: "
                         f"{exc}") from None
