"""The reward-function interface: what a user function may look like, and how the runner tells the kinds apart.

A reward function is one of

* single, sync: ``def f(response: str, answer: Any, **kwargs) -> float``
* single, async: ``async def f(response: str, answer: Any, **kwargs) -> float`` (all samples run concurrently)
* batched, sync or async: ``@batched def f(responses: list[str], answers: list, **kwargs) -> list[float]``

and may return, instead of a number, a dict of named rewards whose key ``"reward"`` is the scalar used for training
(the other keys are recorded as metrics). ``kwargs`` are the recipe's ``reward.kwargs``. A function that declares a
parameter named ``meta`` (batched: ``metas``) also gets each prompt's meta dict (batched: the list of them). A
function that declares a parameter named ``context`` gets the :class:`RewardContext` of the process that scores (the
rollout's engine and tokenizer: a judge on the policy's own engine, see :mod:`relax_hpc.rewards.genrm`); such an
``async`` function runs on the event loop of the rollout driver, where the engine's requests run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_BATCHED_ATTR = "__relax_batched__"
CONTEXT_PARAM = "context"


@dataclass(frozen=True, eq=False)
class RewardContext:
    """What the scoring process lends its reward function (the ``context`` parameter): nothing of it is global."""

    engine: Any = None
    """The rollout's :class:`~relax_hpc.rollout.engine.RolloutEngine` (None where there is none, e.g. in a test)."""
    tokenizer: Any = None
    """The policy's tokenizer (the engine's prompts are token ids)."""
    name: str = "reward"
    """A name for request ids (the rollout driver's writer id), unique among the engine's clients."""
    state: dict[str, Any] = field(default_factory=dict)
    """What a reward keeps between batches of this runner (a judge built at first use)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Scalars the reward reports (the latest value of each; a judge's ``genrm/*`` counters): the rollout logs them
    with each batch's metrics."""


def batched(fn: F | None = None) -> Any:
    """Mark a reward function as batched: it takes ``(responses, answers, **kwargs)`` and returns one value per
    response. Usable as ``@batched`` or ``@batched()``; works on ``def`` and ``async def`` functions."""

    def mark(f: F) -> F:
        setattr(f, _BATCHED_ATTR, True)
        return f

    return mark if fn is None else mark(fn)


def is_batched(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` was marked with :func:`batched`."""
    return bool(getattr(fn, _BATCHED_ATTR, False))


def is_async(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` returns a coroutine (``async def``, or an object with an async ``__call__``)."""
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004 - we want the async-ness of __call__ itself
    return call is not None and inspect.iscoroutinefunction(call)


def accepts_param(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` declares a parameter called ``name`` (not merely ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(name)
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def check_signature(fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Raise ``TypeError`` if ``fn`` cannot be called as ``fn(response(s), answer(s), **kwargs)``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to check
    meta_kw = "metas" if is_batched(fn) else "meta"
    extra: dict[str, Any] = {meta_kw: None} if accepts_param(fn, meta_kw) else {}
    if accepts_param(fn, CONTEXT_PARAM):
        extra[CONTEXT_PARAM] = None
    sig.bind([] if is_batched(fn) else "", None, **kwargs, **extra)
