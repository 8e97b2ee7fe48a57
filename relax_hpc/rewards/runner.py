"""Score a batch of responses with the recipe's reward function, whatever its kind, without ever crashing the run.

A reward that raises, times out, or returns NaN/inf counts as an error (``reward/errors``); its sample
then scores 0 (``on_error: zero``) or is marked in :attr:`RewardResult.dropped` so that the caller drops its whole group
(``on_error: drop``). Sync functions run in the calling thread one sample at a time (no timeout: a sync function
has to bound its own time, as ``math_answer`` does); async functions run concurrently on an event loop under
``reward.timeout_s`` for the whole batch; samples not done by then fail with a timeout. A function that returns
something that is never a number (a string, None, a list) is a user error: :meth:`RewardRunner.score` raises
:class:`~relax_hpc.errors.ConfigError`, and the run stops with that one line (exit 2).

A function that takes the ``context`` parameter (a :class:`~relax_hpc.rewards.api.RewardContext`: the rollout's
engine and tokenizer) gets the runner's context; an async one of those is :attr:`RewardRunner.on_loop`: its caller
awaits :meth:`RewardRunner.score_async` on the loop the engine's requests run on (the rollout driver's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from relax_hpc.config.schema import RewardConfig
from relax_hpc.errors import ConfigError
from relax_hpc.rewards.api import CONTEXT_PARAM, RewardContext, accepts_param, check_signature, is_async, is_batched
from relax_hpc.rewards.registry import resolve_reward
from relax_hpc.rollout.scoring import RewardResult, RewardScorer

log = logging.getLogger(__name__)

_MAX_WARNINGS = 5


class _Bad(Exception):
    """A reward value that is not usable; the message is the reason recorded."""


class _NotANumber(_Bad):
    """A reward value of a type that is never a number (a string, None, a list ...): the function is wrong, not
    the sample, so every sample would score 0 and the run learn nothing. The run stops on it (a user error)."""


def _number(value: Any, what: str) -> float:
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if isinstance(value, (int, float, np.integer, np.floating)) or (isinstance(value, np.ndarray) and value.size == 1):
        x = float(value)
        if not math.isfinite(x):
            raise _Bad(f"{what} is {x}")
        return x
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    raise _NotANumber(f"{what} is a {type(value).__name__} ({shown}), not a number")


def _coerce(value: Any) -> tuple[float, dict[str, float]]:
    """A returned value -> (training reward, extras). Raises :class:`_Bad`."""
    if isinstance(value, dict):
        if "reward" not in value:
            raise _Bad(f"returned a dict without the key 'reward' (keys: {sorted(map(str, value))})")
        extras = {str(k): _number(v, f"reward[{k!r}]") for k, v in value.items() if k != "reward"}
        return _number(value["reward"], "reward['reward']"), extras
    return _number(value, "reward"), {}


def _reason(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:297] + "..."


class RewardRunner(RewardScorer):
    """Runs the reward function of a :class:`RewardConfig` over batches of responses."""

    def __init__(self, cfg: RewardConfig, context: RewardContext | None = None):
        self.cfg = cfg
        self.context = context or RewardContext()
        try:
            self.fn = resolve_reward(cfg.name)
        except ValueError as exc:
            raise ConfigError(f"reward.name: {exc}") from None
        except Exception as exc:
            raise ConfigError(f"reward.name: cannot import reward {cfg.name!r}: {_reason(exc)}") from None
        try:
            check_signature(self.fn, cfg.kwargs)
        except TypeError as exc:
            raise ConfigError(f"reward.kwargs: {cfg.name!r} does not accept {sorted(cfg.kwargs)}: {exc}") from None
        self.batched = is_batched(self.fn)
        self.is_async = is_async(self.fn)
        self._meta_kw = "metas" if self.batched else "meta"
        self._pass_meta = accepts_param(self.fn, self._meta_kw)
        self._pass_context = accepts_param(self.fn, CONTEXT_PARAM)
        self.on_loop = self.is_async and self._pass_context
        """Await :meth:`score_async` on the engine's loop (the function may send requests to the engine)."""
        self._warned = 0

    # ------------------------------------------------------------------------------------------------ public
    def score(self, responses: Sequence[str], answers: Sequence[Any],
              metas: Sequence[dict[str, Any]] | None = None) -> RewardResult:
        """Score ``responses[i]`` against ``answers[i]``. Raises only for a function that returns something that is
        never a number (a :class:`ConfigError`); any other failure of the function counts per sample."""
        metas = _checked_metas(responses, answers, metas)
        n = len(responses)
        if n == 0:
            raw: list[Any] = []
        elif not self.is_async:
            raw = self._run_sync(list(responses), list(answers), metas)
        else:
            coro = self._run_async(list(responses), list(answers), metas)
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                raw = asyncio.run(coro)
            else:  # called from inside an event loop: run ours on a helper thread
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    raw = pool.submit(asyncio.run, coro).result()
        return self._collect(raw)

    async def score_async(self, responses: Sequence[str], answers: Sequence[Any],
                          metas: Sequence[dict[str, Any]] | None = None) -> RewardResult:
        """:meth:`score` on the running loop (an async function runs on it; a sync one blocks it meanwhile)."""
        metas = _checked_metas(responses, answers, metas)
        n = len(responses)
        if n == 0:
            return self._collect([])
        if not self.is_async:
            return self._collect(self._run_sync(list(responses), list(answers), metas))
        return self._collect(await self._run_async(list(responses), list(answers), metas))

    def metrics(self) -> dict[str, float]:
        """What the reward reported through its context (``context.metrics``), to log with the batch's metrics."""
        return dict(self.context.metrics)

    # ------------------------------------------------------------------------------------------------ kinds
    def _kwargs(self, meta: Any) -> dict[str, Any]:
        out = {**self.cfg.kwargs, self._meta_kw: meta} if self._pass_meta else dict(self.cfg.kwargs)
        if self._pass_context:
            out[CONTEXT_PARAM] = self.context
        return out

    def _run_sync(self, responses: list[str], answers: list[Any], metas: list[dict[str, Any]]) -> list[Any]:
        if self.batched:
            try:
                return self._split(self.fn(responses, answers, **self._kwargs(metas)), len(responses))
            except Exception as exc:
                return [exc] * len(responses)
        out: list[Any] = []
        for r, a, m in zip(responses, answers, metas, strict=True):
            try:
                value = self.fn(r, a, **self._kwargs(m))
                if asyncio.iscoroutine(value):
                    value.close()
                    raise _Bad("returned a coroutine: declare the function `async def`")
                out.append(value)
            except Exception as exc:
                out.append(exc)
        return out

    async def _run_async(self, responses: list[str], answers: list[Any], metas: list[dict[str, Any]]) -> list[Any]:
        timeout = self.cfg.timeout_s
        n = len(responses)
        if self.batched:
            try:
                values = await asyncio.wait_for(self.fn(responses, answers, **self._kwargs(metas)), timeout)
                return self._split(values, n)
            except asyncio.TimeoutError:
                return [asyncio.TimeoutError(f"timed out after {timeout:g}s")] * n
            except Exception as exc:
                return [exc] * n

        async def one(r: str, a: Any, m: dict[str, Any]) -> Any:
            return await self.fn(r, a, **self._kwargs(m))

        tasks = [asyncio.ensure_future(one(r, a, m)) for r, a, m in zip(responses, answers, metas, strict=True)]
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)  # let cancellations run; never wait on a task that ignores them
        out: list[Any] = []
        for t in tasks:
            if t in pending:
                out.append(asyncio.TimeoutError(f"timed out after {timeout:g}s"))
            elif t.cancelled():
                out.append(_Bad("was cancelled"))
            else:
                exc = t.exception()
                out.append(exc if exc is not None else t.result())
        return out

    @staticmethod
    def _split(values: Any, n: int) -> list[Any]:
        if isinstance(values, np.ndarray):
            values = values.tolist()
        if not isinstance(values, (list, tuple)):
            return [_Bad(f"batched reward returned a {type(values).__name__}, not a list")] * n
        if len(values) != n:
            return [_Bad(f"batched reward returned {len(values)} values for {n} responses")] * n
        return list(values)

    # ------------------------------------------------------------------------------------------------ results
    def _collect(self, raw: list[Any]) -> RewardResult:
        n = len(raw)
        rewards = np.zeros(n, dtype=np.float32)
        failed = np.zeros(n, dtype=bool)
        reasons: list[str | None] = [None] * n
        extras: dict[str, np.ndarray] = {}
        timeouts = 0
        for i, value in enumerate(raw):
            try:
                if isinstance(value, BaseException):
                    raise value
                reward, named = _coerce(value)
            except _NotANumber as exc:
                what, _, got = str(exc).removesuffix(", not a number").partition(" is ")
                raise ConfigError(f"reward.name: {self.cfg.name} returned {got} as {what} for a sample: a reward "
                                  "is a float (or a dict with a float under 'reward')") from None
            except _Bad as exc:
                failed[i], reasons[i] = True, str(exc)
                continue
            except asyncio.TimeoutError as exc:
                failed[i], reasons[i] = True, f"TimeoutError: {exc}"
                timeouts += 1
                continue
            except Exception as exc:
                failed[i], reasons[i] = True, _reason(exc)
                continue
            rewards[i] = reward
            for k, v in named.items():
                extras.setdefault(k, np.full(n, np.nan, dtype=np.float32))[i] = v
        errors = int(failed.sum())
        self._warn(reasons)
        dropped = failed.copy() if self.cfg.on_error == "drop" else np.zeros(n, dtype=bool)
        counts = {"reward/samples": n, "reward/errors": errors, "reward/timeouts": timeouts}
        return RewardResult(rewards=rewards, extras=extras, failed=failed, reasons=reasons, dropped=dropped,
                            counts=counts)

    def _warn(self, reasons: list[str | None]) -> None:
        bad = [r for r in reasons if r is not None]
        if not bad:
            return
        if self._warned < _MAX_WARNINGS:
            self._warned += 1
            more = "" if self._warned < _MAX_WARNINGS else " (further reward errors are logged at debug level)"
            log.warning("reward %s failed on %d/%d samples (on_error=%s), e.g. %s%s", self.cfg.name, len(bad),
                        len(reasons), self.cfg.on_error, bad[0], more)
        else:
            log.debug("reward %s failed on %d/%d samples: %s", self.cfg.name, len(bad), len(reasons), bad[0])


def _checked_metas(responses: Sequence[str], answers: Sequence[Any],
                   metas: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``metas`` as a list (empty dicts when None), after checking that every argument has one entry per response."""
    n = len(responses)
    if len(answers) != n or (metas is not None and len(metas) != n):
        raise ValueError(f"{n} responses but {len(answers)} answers / {len(metas or [])} metas")
    return list(metas) if metas is not None else [{} for _ in range(n)]
