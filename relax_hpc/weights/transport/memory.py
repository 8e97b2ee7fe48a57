"""The ``memory`` transport (colocate): the in-process engine generates with the trainer's own module
(:class:`~relax_hpc.rollout.engine.SharedModule`: only the version changes) or, where it cannot share it, gets a copy
of the trainer's state (:class:`~relax_hpc.rollout.weight_sync.StateDictStream`). If that hand-over fails, the
engine loads the version's snapshot files instead (event ``weight_fallback``).

The snapshot files, for the monitor, late joiners and recovery, are written every ``publish_every`` steps off the
step's critical path (:class:`BackgroundSnapshots`). On one GPU the backend's asynchronous host copy
(:meth:`~relax_hpc.trainer.backend.TrainerBackend.host_copy_async`) copies the weights into pinned host buffers on a
side stream after the optimizer step (generation, which only reads the weights, runs beside it; the next optimizer
step waits for the copy on the GPU), and the snapshot thread writes them once the copy is done. While the previous
version is still being written a version is skipped (the disk is slower than a step at large shapes; the files then
lag by a version, the generation weights never do); ``final`` always publishes. A backend without that copy (CPU,
FSDP) publishes a synchronous copy in the background.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from relax_hpc.weights.transport.base import WeightSender
from relax_hpc.weights.transport.files import SnapshotFiles

if TYPE_CHECKING:
    from relax_hpc.events import EventLog
    from relax_hpc.rollout.engine import RolloutEngine
    from relax_hpc.rundir import RunDir

log = logging.getLogger(__name__)


class BackgroundSnapshots:
    """Publishes the trainer's weights through ``files`` without the step waiting for a host copy (module
    docstring)."""

    def __init__(self, files: SnapshotFiles):
        self.files = files
        self.trainer = files.session.trainer
        self.async_copy: bool | None = None
        """Whether the backend has the asynchronous host copy (known after the first publish)."""
        self.skipped = 0
        """Versions not written because the previous write was still running."""

    def publish(self, version: int, *, final: bool = False) -> bool:
        """Publish ``version``; False when it was skipped (a write still running, not ``final``)."""
        files = self.files
        if self.async_copy and files.busy() and not final:
            self.skipped += 1
            return False
        files.drain()  # done (or final: wait); re-raises a failed write
        host = self.trainer.host_copy_async() if self.async_copy is not False else None
        if host is None:
            self.async_copy = False
            files.submit(version, self.trainer.full_state_dict(copy=True), private=True)  # a copy nobody changes
            return True
        self.async_copy = True
        files.submit(version, host.weights(), private=True, ready=host.wait)
        return True


class MemorySender(WeightSender):
    """Colocate: the engine in this process gets every version in memory; files every ``publish_every`` steps."""

    kind = "memory"

    def __init__(self, files: SnapshotFiles, engine: RolloutEngine, call: Callable[[Coroutine[Any, Any, Any]], Any], *,
                 run_dir: RunDir, publish_every: int, events: EventLog | None = None, wait_files_s: float = 600.0):
        self.files = files
        self.snapshots = BackgroundSnapshots(files)
        self.trainer = files.session.trainer
        self.engine = engine
        self.call = call
        """Runs a coroutine of the engine on its event loop (the rollout driver's ``call``)."""
        self.run_dir = run_dir
        self.publish_every = publish_every
        self.events = events
        self.wait_files_s = wait_files_s

    def start(self, version: int) -> None:
        self.deliver(version)

    def send(self, version: int, *, final: bool = False) -> None:
        self.deliver(version)
        if final or version % self.publish_every == 0:
            self.snapshots.publish(version, final=final)

    def deliver(self, version: int) -> None:
        """The engine generates with ``version`` next: the same module (shared) or a copy of the trainer's state."""
        from relax_hpc.rollout.engine import SharedModule, WeightSource
        from relax_hpc.rollout.weight_sync import StateDictStream

        source: WeightSource = SharedModule() if self.engine.shared else StateDictStream(
            self.trainer.full_state_dict())
        try:
            self.call(self.engine.receive(version, source))
        except Exception as exc:
            self._from_files(version, exc)

    def _from_files(self, version: int, exc: Exception) -> None:
        from relax_hpc.fsio import is_complete, wait_for
        from relax_hpc.rollout.engine import SnapshotFolder

        msg = f"weights.transport=memory: the hand-over of v{version} failed ({type(exc).__name__}: {exc}); " \
              "loading the snapshot files"
        log.warning(msg)
        if self.events is not None:
            self.events.event("weight_fallback", msg, step=version, level="warning")
        folder = self.run_dir.snapshot(version)
        if self.files.writes and not is_complete(folder):
            self.files.drain()
            self.files.submit(version, self.trainer.full_state_dict(copy=True), private=True)
            self.files.drain()
        wait_for(lambda: is_complete(folder), what=f"the snapshot files of v{version}", timeout_s=self.wait_files_s)
        self.call(self.engine.receive(version, SnapshotFolder(folder)))

    def close(self) -> None:
        self.files.close()
