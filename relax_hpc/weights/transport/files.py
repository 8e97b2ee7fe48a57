"""The ``files`` transport, and the snapshot writer every transport shares.

:class:`SnapshotFiles` writes the weight snapshot files of trainer rank 0 on one background thread, so that the next
step does not wait for their fsyncs. Rollout workers see a version when its LATEST is written (or earlier over a
fast path); the files stay the truth for late joiners and recovery.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

from relax_hpc.weights.transport.base import WeightReceiver, WeightSender

if TYPE_CHECKING:
    from relax_hpc.events import EventLog
    from relax_hpc.rollout.engine import RolloutEngine
    from relax_hpc.rollout.weight_sync import WeightSync
    from relax_hpc.rundir import RunDir
    from relax_hpc.trainer.session import TrainerSession


class SnapshotFiles:
    """Publishes snapshot files on one background thread, in version order: at most one publish is in flight and
    the next :meth:`submit` waits for it. :meth:`drain` waits for the pending publish and re-raises its error."""

    def __init__(self, session: TrainerSession):
        self.session = session
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="snapshot") if session.publisher is not None else None
        self.pending: Future[None] | None = None
        self.last_submit = time.monotonic()
        """When the last version was handed to :meth:`submit` (``time.monotonic()``; creation counts as one)."""

    @property
    def writes(self) -> bool:
        """Whether this rank writes the files (trainer rank 0)."""
        return self.pool is not None

    def busy(self) -> bool:
        """Whether a publish is still running."""
        return self.pending is not None and not self.pending.done()

    def submit(self, version: int, state_dict: dict[str, Any], *, private: bool = False,
               ready: Callable[[], None] | None = None) -> None:
        """Publish ``state_dict`` as ``version`` in the background. ``private``: nothing changes its tensors later
        (``full_state_dict(copy=True)``, a fast path's packed copy, a host copy); otherwise the backend copies those
        that are live weights first. ``ready``: called on the writing thread first (waits for an async copy)."""
        if self.pool is None:
            return
        self.drain()
        self.last_submit = time.monotonic()
        sd = state_dict if private else self.session.trainer.detached(state_dict)
        self.pending = self.pool.submit(self._publish, version, sd, ready)

    def _publish(self, version: int, state_dict: dict[str, Any], ready: Callable[[], None] | None) -> None:
        if ready is not None:
            ready()
        trainer, publisher = self.session.trainer, self.session.publisher
        assert publisher is not None
        if publisher.is_new(version):  # never trips over a version already on disk
            publisher.publish(state_dict, version=version, step=version, model_config=trainer.hf_config(),
                              generation_config=trainer.generation_config(), adapter=trainer.adapter_config())
        else:
            publisher.adopt(version)

    def drain(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.drain()
        if self.pool is not None:
            self.pool.shutdown()


class FilesSender(WeightSender):
    """Every published version as snapshot files (every ``publish_every`` steps and the last)."""

    kind = "files"

    def __init__(self, files: SnapshotFiles, *, publish_every: int):
        self.files = files
        self.trainer = files.session.trainer
        self.publish_every = publish_every

    def due(self, version: int, final: bool) -> bool:
        return final or version % self.publish_every == 0

    def send(self, version: int, *, final: bool = False) -> None:
        if self.due(version, final):
            self.files.submit(version, self.trainer.full_state_dict(copy=True), private=True)

    def close(self) -> None:
        self.files.close()


class EngineFilesSender(WeightSender):
    """Colocate with a server engine: every version is published as snapshot files (trainer rank 0; the step waits
    for them) and the engine of this rank loads them into its server (SGLang ``update_weights_from_disk``, vLLM's
    ``reload_weights``). Other ranks wait for the files (bounded) and load them into their own servers. The files
    path works for every server on every machine; a path from the trainer's memory (vLLM's CUDA-IPC weight
    transfer, GPU only) would be another transport of this seam."""

    kind = "files"

    def __init__(self, files: SnapshotFiles, engine: RolloutEngine, call: Callable[[Coroutine[Any, Any, Any]], Any],
                 *, run_dir: RunDir, verify: Literal["sha256", "size"] = "sha256", wait_files_s: float = 600.0):
        self.files = files
        self.trainer = files.session.trainer
        self.engine = engine
        self.call = call
        """Runs a coroutine of the engine on its event loop (the rollout driver's ``call``)."""
        self.run_dir = run_dir
        self.verify = verify
        """How the engine checks a folder before its server reads it (``weights.verify``)."""
        self.wait_files_s = wait_files_s

    def start(self, version: int) -> None:
        from relax_hpc.fsio import is_complete

        if not is_complete(self.run_dir.snapshot(version)):  # a resumed run has its files; a new one writes them
            self.files.submit(version, self.trainer.full_state_dict(copy=True), private=True)
        self.deliver(version)

    def send(self, version: int, *, final: bool = False) -> None:
        self.files.submit(version, self.trainer.full_state_dict(copy=True), private=True)
        self.deliver(version)

    def deliver(self, version: int) -> None:
        """Wait for ``version``'s files (rank 0: its own write), then the engine loads them."""
        from relax_hpc.fsio import is_complete, wait_for
        from relax_hpc.rollout.engine import SnapshotFolder

        self.files.drain()  # re-raises a failed write
        folder = self.run_dir.snapshot(version)
        wait_for(lambda: is_complete(folder), what=f"the snapshot files of v{version}", timeout_s=self.wait_files_s)
        self.call(self.engine.receive(version, SnapshotFolder(folder, verify=self.verify)))

    def close(self) -> None:
        self.files.close()


class SyncReceiver(WeightReceiver):
    """A receiver over :class:`~relax_hpc.rollout.weight_sync.WeightSync` (files, and its fast path if it has
    one): a fast path that worked and fails now is logged as event ``weight_fallback`` (the files are used), its
    return as ``weight_fast_path_back``; a link that ends with the run (STATUS.json written) as
    ``weight_link_closed``."""

    def __init__(self, kind: str, sync: WeightSync, events: EventLog | None = None):
        self.kind = kind
        self.sync = sync
        self.events = events
        self.fast = sync.fast is not None
        self.up = False
        """Whether the last use of the fast path worked."""

    def newest(self) -> int | None:
        return self.sync.newest()

    def _note(self, ok: bool, newest: int | None) -> None:
        if ok == self.up:
            return
        self.up = ok
        if self.events is None:
            return
        if ok:
            self.events.event("weight_fast_path_back", f"weights.transport={self.kind}: new weights over its link")
        elif self.sync.run_dir.status_file.exists():  # the trainer closed the link at the end of the run
            self.events.event("weight_link_closed", f"weights.transport={self.kind}: the trainer closed its link "
                              "at the end of the run")
        else:
            self.events.event("weight_fallback", f"weights.transport={self.kind}: no usable link; new weights come "
                              f"from the snapshot files (newest v{newest})", level="warning")

    async def pull(self) -> int | None:
        if not self.fast:
            return None
        got = await self.sync.pull_fast()
        self._note(got is not None, self.newest())
        return got

    async def load_files(self, version: int) -> int:
        return await self.sync.load_files(version)

    async def update(self, *, files_first: bool) -> tuple[int, str]:
        newest = self.newest()
        if not files_first and self.fast:
            got = await self.pull()
            if got is not None and newest is not None and got >= newest:
                return got, "fast"
        return await self.sync.load_files(), "file"

    def close(self) -> None:
        self.sync.close()
