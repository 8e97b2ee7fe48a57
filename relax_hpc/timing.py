"""A small phase timer: the loops say which phase they are in; the seconds per phase come out as metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class PhaseTimer:
    """Seconds spent per named phase (a phase entered twice adds up). ``with timer.phase("generate"): ...``"""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t0 = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def get(self, name: str) -> float:
        return self.seconds.get(name, 0.0)

    def elapsed(self) -> float:
        """Seconds since the timer was made (or :meth:`reset`)."""
        return time.perf_counter() - self._t0

    def reset(self) -> None:
        self.seconds = {}
        self._t0 = time.perf_counter()

    def metrics(self, names: Mapping[str, str]) -> dict[str, float]:
        """``{metric: seconds}`` for ``names = {phase: metric}`` (0 for phases not entered)."""
        return {metric: self.get(phase) for phase, metric in names.items()}
