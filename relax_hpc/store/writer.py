"""Publishing shards: validate, write to ``samples/tmp``, fsync, rename into the writer's folder in ``seq`` order."""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from relax_hpc.errors import RunDirError
from relax_hpc.fsio import TMP_PREFIX, fsync_dir
from relax_hpc.rundir import RunDir
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


def open_run_dir(run_dir: RunDir | Path | str) -> RunDir:
    """A :class:`RunDir` for an existing run; :class:`RunDirError` if the folder is not one."""
    if isinstance(run_dir, RunDir):
        run_dir.info()
        return run_dir
    return RunDir.open(run_dir)


def describe_oserror(exc: OSError) -> str:
    """A short reason for an OSError (full disk, read-only filesystem ...)."""
    return _REASONS.get(exc.errno or 0) or exc.strerror or str(exc)


@dataclass(frozen=True)
class ShardInfo:
    """What :meth:`ShardWriter.write` published."""

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
    Reusing an id continues its numbering after the highest published ``seq``.
    """

    def __init__(self, run_dir: RunDir | Path | str, writer_id: str | None = None, *, fsync: bool = True):
        self.run_dir = open_run_dir(run_dir)
        self.writer_id = check_writer_id(writer_id) if writer_id is not None else new_writer_id()
        self.fsync = fsync
        self.folder = self.run_dir.writer_shards(self.writer_id)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.run_dir.samples_tmp.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(f"cannot create shard folder {self.folder}: {describe_oserror(exc)}") from exc
        existing = list_shards(self.run_dir, self.writer_id)
        self.next_seq = existing[-1].seq + 1 if existing else 0

    def write(self, groups: Sequence[SampleGroup] | SampleGroup) -> ShardInfo:
        """Validate and publish ``groups`` as one shard (atomic: the shard is visible complete, or not at all).

        Raises :class:`SampleValidationError` (nothing written) or :class:`RunDirError` naming the file on a full
        disk or a read-only run dir (earlier shards untouched; the same ``seq`` is retried by the next call).
        """
        if isinstance(groups, SampleGroup):
            groups = [groups]
        seq = self.next_seq
        enc = encode_shard(list(groups), writer_id=self.writer_id, seq=seq)
        name = shard_name(seq, enc.num_samples, enc.num_groups, enc.min_version, enc.max_version)
        final = self.run_dir.shard_file(self.writer_id, name)
        tmp = self.run_dir.samples_tmp_file(f"{TMP_PREFIX}{self.writer_id}.{name}")
        try:
            enc.write(tmp, fsync=self.fsync)
            os.rename(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise RunDirError(f"cannot write shard {final}: {describe_oserror(exc)}") from exc
        if self.fsync:
            fsync_dir(self.folder)
        self.next_seq = seq + 1
        return ShardInfo(
            final, self.writer_id, seq, enc.num_samples, enc.num_groups, enc.min_version, enc.max_version, enc.nbytes
        )
