"""Publishing shards: validate, write to ``samples/tmp``, fsync, rename into the writer's folder in ``seq`` order,
then announce the shard (``samples/announce``, :mod:`relax_hpc.store.announce`: a hint for the planner).

With ``background=True`` the fsync and rename of shard ``n`` run on one publisher thread while the caller encodes
shard ``n+1`` (fsync releases the GIL), still strictly in ``seq`` order. If a publish fails, the shards queued after
it are discarded (their temporary files removed) and the writer rewinds to the failed ``seq``, so a gap in the
sequence never appears; the error is raised by the next :meth:`ShardWriter.write`, :meth:`~ShardWriter.flush` or
:meth:`~ShardWriter.close`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from relax_hpc.errors import RunDirError
from relax_hpc.fsio import TMP_PREFIX, fsync_dir
from relax_hpc.rundir import RunDir
from relax_hpc.store.announce import HEAD_NAMES, announce, write_head
from relax_hpc.store.layout import check_writer_id, list_shards, shard_name
from relax_hpc.store.sample import SampleGroup
from relax_hpc.store.shard import encode_shard

_REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
    errno.EDQUOT: "disk quota exceeded",
}


def new_writer_id(prefix: str = "writer") -> str:
    """A writer id unique to this incarnation: ``<prefix>.<8 hex>`` (e.g. ``rollout-3.9f2c1a7b``)."""
    return check_writer_id(f"{prefix}.{uuid.uuid4().hex[:8]}")


_RUN_DIRS: set[Path] = set()


def open_run_dir(run_dir: RunDir | Path | str) -> RunDir:
    """A :class:`RunDir` for an existing run; :class:`RunDirError` if the folder is not one.

    A run dir stays one (``RUN.json`` is written once, at creation), so a :class:`RunDir` whose root was checked
    by this process is not checked again.
    """
    if isinstance(run_dir, RunDir):
        if run_dir.root not in _RUN_DIRS:
            run_dir.info()
            _RUN_DIRS.add(run_dir.root)
        return run_dir
    rd = RunDir.open(run_dir)
    _RUN_DIRS.add(rd.root)
    return rd


def describe_oserror(exc: OSError) -> str:
    """A short reason for an OSError (full disk, read-only filesystem ...)."""
    return _REASONS.get(exc.errno or 0) or exc.strerror or str(exc)


@dataclass(frozen=True)
class ShardInfo:
    """What :meth:`ShardWriter.write` published (with ``background=True``: will publish, in order)."""

    path: Path
    writer_id: str
    seq: int
    num_samples: int
    num_groups: int
    min_version: int
    max_version: int
    nbytes: int


class ShardWriter:
    """Publishes shards of complete prompt groups for one writer incarnation. Not thread-safe.

    ``writer_id`` must be unique per incarnation (a restarted worker takes a new one; :func:`new_writer_id`).
    Reusing an id continues its numbering after the highest published ``seq``. ``fsync`` makes a shard durable
    before it becomes visible; ``fsync_dir`` also makes the rename itself durable (one more journal commit per shard:
    without it a power loss may forget the newest renames, losing those samples but never exposing a partial shard).
    """

    def __init__(
        self,
        run_dir: RunDir | Path | str,
        writer_id: str | None = None,
        *,
        fsync: bool = True,
        fsync_dir: bool = False,
        background: bool = False,
        max_pending: int = 4,
    ):
        self.run_dir = open_run_dir(run_dir)
        self.writer_id = check_writer_id(writer_id) if writer_id is not None else new_writer_id()
        self.fsync, self.fsync_dir = fsync, fsync_dir
        self.folder = self.run_dir.writer_shards(self.writer_id)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.run_dir.samples_tmp.mkdir(parents=True, exist_ok=True)
            self.run_dir.announce.mkdir(parents=True, exist_ok=True)
            self.run_dir.heads.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(f"cannot create shard folder {self.folder}: {describe_oserror(exc)}") from exc
        existing = list_shards(self.run_dir, self.writer_id)
        self.next_seq = existing[-1].seq + 1 if existing else 0
        self._recent = [r.name for r in existing[-HEAD_NAMES:]]  # the names this writer's head gives
        self._queue: queue.Queue[tuple[int, Path, Path] | None] | None = None
        self._thread: threading.Thread | None = None
        self._error: tuple[int, RunDirError] | None = None
        self._lock = threading.Lock()
        if background:
            self._queue = queue.Queue(maxsize=max_pending)
            self._thread = threading.Thread(target=self._publisher, name=f"publish-{self.writer_id}", daemon=True)
            self._thread.start()

    def write(self, groups: Sequence[SampleGroup] | SampleGroup) -> ShardInfo:
        """Validate and publish ``groups`` as one shard (atomic: the shard is visible complete, or not at all).

        Raises :class:`SampleValidationError` (nothing written) or :class:`RunDirError` naming the file on a full
        disk or a read-only run dir (earlier shards untouched; the same ``seq`` is retried by the next call).
        """
        self._raise_error()
        if isinstance(groups, SampleGroup):
            groups = [groups]
        seq = self.next_seq
        enc = encode_shard(list(groups), writer_id=self.writer_id, seq=seq)
        name = shard_name(seq, enc.num_samples, enc.num_groups, enc.min_version, enc.max_version)
        final = self.run_dir.shard_file(self.writer_id, name)
        tmp = self.run_dir.samples_tmp_file(f"{TMP_PREFIX}{self.writer_id}.{name}")
        synced = self.fsync and self._queue is None  # with a publisher thread, it fsyncs
        try:
            enc.write(tmp, fsync=synced)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise RunDirError(f"cannot write shard {final}: {describe_oserror(exc)}") from exc
        self.next_seq = seq + 1
        if self._queue is not None:
            self._queue.put((seq, tmp, final))
        else:
            try:
                self._publish(tmp, final, synced=synced)
            except RunDirError:
                self.next_seq = seq
                raise
        return ShardInfo(
            final, self.writer_id, seq, enc.num_samples, enc.num_groups, enc.min_version, enc.max_version, enc.nbytes
        )

    def _publish(self, tmp: Path, final: Path, *, synced: bool = False) -> None:
        try:
            if self.fsync and not synced:
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.rename(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise RunDirError(f"cannot write shard {final}: {describe_oserror(exc)}") from exc
        if self.fsync_dir:
            fsync_dir(self.folder)
        announce(self.run_dir, self.writer_id, final.name)  # after the publish: a hint for the planner
        self._recent = [*self._recent[-(HEAD_NAMES - 1):], final.name]
        write_head(self.run_dir, self.writer_id, self._recent)  # the same hint, read by name

    def _publisher(self) -> None:
        assert self._queue is not None
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                seq, tmp, final = job
                with self._lock:
                    failed = self._error is not None
                if failed:  # a shard before this one failed: never publish past the gap
                    with contextlib.suppress(OSError):
                        tmp.unlink()
                    continue
                try:
                    self._publish(tmp, final)
                except RunDirError as exc:
                    with self._lock:
                        self._error = (seq, exc)
            finally:
                self._queue.task_done()

    def _raise_error(self) -> None:
        with self._lock:
            err = self._error
        if err is None:
            return
        if self._queue is not None:
            self._queue.join()  # while the error is set, the publisher discards every shard queued after it
        with self._lock:
            self._error = None
        self.next_seq = err[0]
        raise err[1]

    def flush(self) -> None:
        """Wait until every shard written so far is published; raise the first publish error, if any."""
        if self._queue is not None:
            self._queue.join()
        self._raise_error()

    def close(self) -> None:
        """Flush and stop the publisher thread (idempotent)."""
        try:
            self.flush()
        finally:
            if self._thread is not None and self._queue is not None:
                self._queue.put(None)
                self._thread.join(timeout=60)
                self._thread = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
