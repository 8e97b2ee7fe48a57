"""The weight transport seam: how a trainer's new weights reach the rollout engines.

A :class:`WeightSender` lives on every trainer rank (rank 0 sends; gathering the weights may be a collective) and a
:class:`WeightReceiver` in every fully_async rollout worker. Every transport writes the snapshot files as well (the
truth for late joiners, recovery and the monitor); a receiver whose own path fails loads the files and says so in
its event log (event ``weight_fallback``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class WeightSender(ABC):
    """Trainer side of a transport. The mode calls :meth:`start` once, :meth:`send` after every optimizer step,
    :meth:`idle` while it waits for samples, :meth:`close` at the end."""

    kind: str
    """The ``weights.transport.kind`` this implements."""

    def start(self, version: int) -> None:  # noqa: B027 - optional hook
        """Hand the engines the weights the run starts from (their files are already published)."""

    @abstractmethod
    def send(self, version: int, *, final: bool = False) -> None:
        """The trainer's weights are now ``version``: hand them over (and publish the snapshot files when due;
        ``final``: always, and wait for nothing to be skipped)."""

    def idle(self) -> None:  # noqa: B027 - optional hook
        """Called while the trainer waits (e.g. write files a late joiner needs)."""

    @abstractmethod
    def close(self) -> None:
        """Finish the pending snapshot write (re-raising its error) and stop serving."""


class WeightReceiver(ABC):
    """Rollout side of a transport: brings the worker's engine to the newest version."""

    kind: str
    """The ``weights.transport.kind`` this implements."""
    fast: bool = False
    """Whether it has a path besides the files (then :meth:`pull` may bring weights before LATEST names them)."""

    @abstractmethod
    def newest(self) -> int | None:
        """The newest published version (its files are complete), None before the first."""

    @abstractmethod
    async def update(self, *, files_first: bool) -> tuple[int, str]:
        """Load the newest version into the engine: (version, ``"fast"`` or ``"file"``). ``files_first``: from the
        files (a worker's first weights)."""

    async def pull(self) -> int | None:
        """Newer weights over the fast path, if any: the version now held, or None without a usable path."""
        return None

    @abstractmethod
    async def load_files(self, version: int) -> int:
        """Load snapshot ``version`` (which may be older than the newest: the base model an evaluating worker
        scores first) from its files into the engine; its version. :class:`~relax_hpc.errors.SnapshotError` when
        that snapshot is gone."""

    @abstractmethod
    def close(self) -> None:
        """Release the links."""
