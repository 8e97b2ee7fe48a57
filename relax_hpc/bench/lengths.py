"""Length mixes for the benchmarks (``bench step``, ``bench generate``): ``--lengths uniform``,
``lognormal:mean=512,sigma=1.0,cap=4096`` or ``file:lengths.json``, applied as each request's ``max_new_tokens``.

Random weights almost never sample EOS, so every response runs to its budget: a request's drawn length *is* its
response length, and a benchmark on random weights sees the long-tailed lengths of real RL (reasoning runs: a mean of
a few thousand tokens, a tail many times longer). A request's length depends only on its request id (a hash seeds
the draw), so two runs, or two decoders, see the same lengths for the same requests. All ``n`` samples of a request
share its length, and so do all engine calls of a prompt's episode (the request id up to its first ``/``, as the
rollout driver names them): a sample continued from a prefix (a partial rollout carried into the next step, an
abort after a weight update) keeps its drawn length, the prefix counting against it.

- ``uniform``: every request the benchmark's own ``max_new_tokens`` (what the benchmarks did before);
- ``lognormal:mean=M,sigma=S,cap=C``: a log-normal whose mean (before the cap) is ``M`` tokens, ``sigma`` the
  standard deviation of its log, rounded and clipped to [1, C];
- ``file:PATH``: a JSON list of positive integers (or ``{"lengths": [...]}``), one picked per request.

:class:`LengthMixEngine` wraps an engine: it sets each request's ``max_new_tokens`` and, for ``bench step``, records
the engine's decode metrics at every weight hand-over (one window per training step).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.errors import UserError
from relax_hpc.rollout.engine import (
    EngineHealth,
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    WeightSource,
)


def _rng(request_id: str) -> np.random.Generator:
    return np.random.default_rng(int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little"))


@dataclass(frozen=True)
class Uniform:
    tokens: int

    @property
    def cap(self) -> int:
        return self.tokens

    def length(self, request_id: str) -> int:
        return self.tokens

    def describe(self) -> str:
        return f"uniform ({self.tokens})"


@dataclass(frozen=True)
class LogNormal:
    mean: float
    sigma: float
    cap: int

    def length(self, request_id: str) -> int:
        mu = math.log(self.mean) - self.sigma ** 2 / 2  # the mean of exp(N(mu, sigma^2)) is exp(mu + sigma^2 / 2)
        return int(min(self.cap, max(1, round(float(_rng(request_id).lognormal(mu, self.sigma))))))

    def describe(self) -> str:
        return f"lognormal:mean={self.mean:g},sigma={self.sigma:g},cap={self.cap}"


@dataclass(frozen=True)
class FromFile:
    path: str
    lengths: tuple[int, ...]

    @property
    def cap(self) -> int:
        return max(self.lengths)

    def length(self, request_id: str) -> int:
        return self.lengths[int(_rng(request_id).integers(len(self.lengths)))]

    def describe(self) -> str:
        return f"file:{self.path} ({len(self.lengths)} lengths)"


LengthLaw = Uniform | LogNormal | FromFile


def parse_lengths(spec: str, default_tokens: int) -> LengthLaw:
    """The law ``spec`` names (``default_tokens``: the ``uniform`` length); bad input is one :class:`UserError`."""
    kind, _, rest = spec.partition(":")
    if kind == "uniform" and not rest:
        return Uniform(default_tokens)
    if kind == "lognormal":
        return _lognormal(rest, spec)
    if kind == "file" and rest:
        return _from_file(rest)
    raise UserError(f"--lengths {spec!r}: expected uniform, lognormal:mean=M,sigma=S,cap=C or file:PATH")


def _lognormal(rest: str, spec: str) -> LogNormal:
    fields: dict[str, str] = {}
    for part in filter(None, rest.split(",")):
        key, eq, value = part.partition("=")
        if not eq or key not in ("mean", "sigma", "cap"):
            raise UserError(f"--lengths {spec!r}: {part!r} is not mean=, sigma= or cap=")
        fields[key] = value
    try:
        mean, sigma = float(fields.get("mean", "512")), float(fields.get("sigma", "1.0"))
        cap = int(fields.get("cap", "4096"))
    except ValueError:
        raise UserError(f"--lengths {spec!r}: mean and sigma must be numbers, cap an integer") from None
    if not (mean >= 1 and sigma >= 0 and cap >= 1 and math.isfinite(mean) and math.isfinite(sigma)):
        raise UserError(f"--lengths {spec!r}: mean must be >= 1, sigma >= 0, cap >= 1")
    return LogNormal(mean, sigma, cap)


def _from_file(path: str) -> FromFile:
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text())
    except OSError as exc:
        raise UserError(f"--lengths file:{path}: cannot read it ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"--lengths file:{path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    values = data.get("lengths") if isinstance(data, dict) else data
    if not isinstance(values, list) or not values or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise UserError(f"--lengths file:{path}: expected a non-empty JSON list of integers >= 1 "
                        "(or {\"lengths\": [...]})")
    return FromFile(path, tuple(values))


def percentiles(lengths: Sequence[float]) -> dict[str, float]:
    """p50, p99, max and mean of response lengths (empty: none)."""
    if not len(lengths):
        return {}
    a = np.asarray(lengths, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max()),
            "mean": float(a.mean())}


class LengthMixEngine(RolloutEngine):
    """An engine whose requests get their ``max_new_tokens`` from a :data:`LengthLaw` (never more than they asked
    for); the engine's decode metrics are read at every :meth:`receive` (a training step's hand-over) into
    :attr:`windows`. Everything else is the wrapped engine's."""

    def __init__(self, inner: RolloutEngine, law: LengthLaw):
        self.inner, self.law = inner, law
        self.windows: list[dict[str, float]] = []
        # the capabilities are the wrapped engine's (the class defaults would declare a shared module's engine
        # unshared: the colocate hand-over then copied the trainer's state into its own module)
        self.shared, self.threaded, self.can_sleep = inner.shared, inner.threaded, inner.can_sleep

    @property
    def version(self) -> int:
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:
        self.inner.version = value

    def __getattr__(self, name: str) -> Any:  # the wrapped engine's own attributes (shared, threaded, ...)
        if name in ("inner", "law", "windows"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        s = request.sampling
        budget = min(s.max_new_tokens, self.law.length(request.request_id.split("/", 1)[0]))
        return await self.inner.generate(replace(request, sampling=replace(s, max_new_tokens=budget)))

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        await self.inner.abort(request_ids)

    async def pause(self, *, abort: bool = True) -> None:
        await self.inner.pause(abort=abort)

    async def resume(self) -> None:
        await self.inner.resume()

    async def receive(self, version: int, source: WeightSource) -> None:
        self.windows.append(self.inner.metrics())
        await self.inner.receive(version, source)

    async def health(self) -> EngineHealth:
        return await self.inner.health()

    async def close(self) -> None:
        self.windows.append(self.inner.metrics())
        await self.inner.close()

    async def run_on_thread(self, fn: Callable[[], Any]) -> Any:
        return await self.inner.run_on_thread(fn)

    async def sleep(self, level: int) -> None:
        await self.inner.sleep(level)

    async def wake(self, *, weights_only: bool = False) -> None:
        await self.inner.wake(weights_only=weights_only)

    def metrics(self) -> dict[str, float]:
        return self.inner.metrics()

    def weight_template(self) -> Mapping[str, Any] | None:
        return self.inner.weight_template()

    def transfer_ranks(self) -> int | None:
        return self.inner.transfer_ranks()


class LengthMixWrapper:
    """Wraps each engine it is given in :class:`LengthMixEngine` and keeps them (``run_colocate(wrap_engine=...)``,
    for ``bench step``, which runs the colocate loop in its own process)."""

    def __init__(self, law: LengthLaw):
        self.law = law
        self.engines: list[LengthMixEngine] = []

    def __call__(self, engine: Any) -> Any:
        wrapped = LengthMixEngine(engine, self.law)
        self.engines.append(wrapped)
        return wrapped


def occupancy(windows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The decode metrics of several windows together: occupancy weighted by decode steps, seconds summed."""
    ws = [w for w in windows if w.get("perf/decode_steps")]
    steps = sum(w["perf/decode_steps"] for w in ws)
    if not steps:
        return {}
    return {"decode_occupancy": sum(w["perf/decode_occupancy"] * w["perf/decode_steps"] for w in ws) / steps,
            "decode_steps": steps, "decode_s": sum(w.get("perf/decode_time", 0.0) for w in ws),
            "decode_low_occupancy_s": sum(w.get("perf/decode_low_occupancy_time", 0.0) for w in ws)}
