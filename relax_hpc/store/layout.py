"""The sample store's file-level protocol: shard names, listings, read positions and quarantine.

A published shard is ``samples/shards/<writer_id>/<seq>.s<N>.g<G>.v<min>-<max>.h5``: listing the folders gives the
backlog and staleness without opening a file. A writer renames its shards into place in ``seq`` order, so a visible
``seq`` implies every smaller one was published (gaps are shards already deleted or quarantined).

A read position is a vector clock over writer incarnations::

    {"format": 1, "consumer": "trainer", "step": 12,
     "writers": {"rollout-3.9f2c1a7b": [next_seq, next_group, next_sample], ...}}

``[s, g, k]`` means: shards ``< s`` are consumed, and in shard ``s`` the first ``g`` groups (``k`` samples) are.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.errors import StoreError, UserError
from relax_hpc.fsio import atomic_write_json, read_json
from relax_hpc.rundir import RunDir

log = logging.getLogger("relax_hpc.store")

POSITION_FORMAT = 1
SHARD_RE = re.compile(r"^(\d{12})\.s(\d+)\.g(\d+)\.v(\d+)-(\d+)\.h5$")
WRITER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
CONSUMER_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
#: SHARD_RE over names joined by NUL (a character no file name holds): each match is one whole name.
_SHARDS_RE = re.compile(r"(?<![^\0])(\d{12})\.s(\d+)\.g(\d+)\.v(\d+)-(\d+)\.h5(?![^\0])")


def shard_name(seq: int, num_samples: int, num_groups: int, min_version: int, max_version: int) -> str:
    """The file name of a published shard: ``000000000012.s64.g8.v5-7.h5``."""
    return f"{seq:012d}.s{num_samples}.g{num_groups}.v{min_version}-{max_version}.h5"


@dataclass(frozen=True, slots=True)
class ShardRef:
    """A published shard as its name describes it (no file opened)."""

    writer_id: str
    seq: int
    num_samples: int
    num_groups: int
    min_version: int
    max_version: int

    @property
    def name(self) -> str:
        return shard_name(self.seq, self.num_samples, self.num_groups, self.min_version, self.max_version)

    @property
    def rel(self) -> str:
        """``<writer_id>/<name>``, how plans refer to the shard."""
        return f"{self.writer_id}/{self.name}"

    @property
    def quarantine_name(self) -> str:
        return f"{self.writer_id}.{self.name}"

    @classmethod
    def parse(cls, writer_id: str, name: str) -> ShardRef | None:
        """The ref of a file name, or None for anything that is not a published shard name."""
        m = SHARD_RE.match(name)
        if m is None:
            return None
        seq, n, g, vmin, vmax = (int(x) for x in m.groups())
        return cls(writer_id, seq, n, g, vmin, vmax)

    @classmethod
    def from_rel(cls, rel: str) -> ShardRef:
        writer_id, _, name = rel.partition("/")
        ref = cls.parse(writer_id, name)
        if ref is None:
            raise StoreError(f"not a shard reference: {rel!r}")
        return ref


def check_writer_id(writer_id: str) -> str:
    """Validate a writer id (a folder name): letters, digits, ``_.-``, at most 128 characters."""
    if not isinstance(writer_id, str) or not WRITER_RE.match(writer_id):
        raise UserError(f"writer_id must match {WRITER_RE.pattern}, got {writer_id!r}")
    return writer_id


def check_consumer(name: str) -> str:
    """Validate a consumer group name."""
    if not isinstance(name, str) or not CONSUMER_RE.match(name):
        raise UserError(f"consumer name must match {CONSUMER_RE.pattern}, got {name!r}")
    return name


class StorePaths:
    """Paths of one run dir's sample store, each folder made once (a :class:`RunDir` builds a new ``Path`` per call,
    ~5 us per component, and a trainer step needs dozens)."""

    def __init__(self, rd: RunDir):
        self.rd = rd
        self.shards = str(rd.shards)
        self._writers: dict[str, Path] = {}

    def writer_folder(self, writer_id: str) -> Path:
        """``rd.writer_shards(writer_id)``."""
        folder = self._writers.get(writer_id)
        if folder is None:
            if len(self._writers) > 4096:
                self._writers.clear()
            folder = self._writers[writer_id] = self.rd.writer_shards(writer_id)
        return folder

    def shard_file(self, writer_id: str, name: str) -> Path:
        """``rd.shard_file(writer_id, name)``: a file of the writer's folder."""
        return self.writer_folder(writer_id) / name


@functools.lru_cache(maxsize=16)
def store_paths(rd: RunDir) -> StorePaths:
    """The (cached) :class:`StorePaths` of ``rd``."""
    return StorePaths(rd)


def list_writers(rd: RunDir) -> list[str]:
    """Writer incarnations that have a shard folder."""
    try:
        return sorted(e.name for e in os.scandir(store_paths(rd).shards) if e.is_dir() and WRITER_RE.match(e.name))
    except FileNotFoundError:
        return []


def scan_shards(rd: RunDir, writer_id: str, from_seq: int = 0) -> list[tuple[int, int, int, int, int]]:
    """``(seq, num_samples, num_groups, min_version, max_version)`` of one writer's published shards with
    ``seq >= from_seq``, in seq order: one directory listing and one regex pass over all names together."""
    try:
        names = os.listdir(store_paths(rd).writer_folder(writer_id))
    except FileNotFoundError:
        return []
    found = [(int(q), int(n), int(g), int(lo), int(hi)) for q, n, g, lo, hi in _SHARDS_RE.findall("\0".join(names))]
    found = [t for t in found if t[0] >= from_seq] if from_seq else found
    found.sort()
    return found


LISTING_MAX_AGE_S = 5.0
"""A cached listing of a writer folder whose stat did not change is reused for at most this long (then listed
again: a filesystem with coarse directory times, or an attribute cache, may hide a change from the stat)."""
_listings: dict[str, tuple[tuple[int, int, int, int], float, list[tuple[int, int, int, int, int]]]] = {}


def scan_shards_cached(rd: RunDir, writer_id: str, from_seq: int = 0, *, fresh: bool = False
                       ) -> list[tuple[int, int, int, int, int]]:
    """:func:`scan_shards` that lists a writer folder again only when its ``stat`` changed (a shard renamed in or
    deleted) or its cached listing is older than ``LISTING_MAX_AGE_S`` (``fresh``: always). A planner with 1024
    writers of which a few published since the last step pays ~1024 stats instead of ~1024 listings."""
    folder = str(store_paths(rd).writer_folder(writer_id))
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        _listings.pop(folder, None)
        return []
    stamp = (st.st_mtime_ns, st.st_ino, st.st_size, st.st_nlink)
    now = time.monotonic()
    cached = _listings.get(folder)
    if fresh or cached is None or cached[0] != stamp or now - cached[1] > LISTING_MAX_AGE_S:
        cached = (stamp, now, scan_shards(rd, writer_id))
        _listings[folder] = cached
        if len(_listings) > 65_536:  # writer incarnations of many runs in one process: forget the oldest
            _listings.pop(next(iter(_listings)))
    return [t for t in cached[2] if t[0] >= from_seq]


def list_shards(rd: RunDir, writer_id: str, from_seq: int = 0) -> list[ShardRef]:
    """Published shards of one writer with ``seq >= from_seq``, in seq order (names only; cheap)."""
    return [ShardRef(writer_id, *t) for t in scan_shards(rd, writer_id, from_seq)]


# ----------------------------------------------------------------------------------------------------- positions
def empty_position(consumer: str, step: int | None = None) -> dict[str, Any]:
    """The position of a consumer that has read nothing."""
    return {"format": POSITION_FORMAT, "consumer": consumer, "step": step, "writers": {}}


def check_position(position: Any, consumer: str) -> dict[str, Any]:
    """Validate a position (e.g. one restored from a checkpoint) and return a normalised copy."""
    if not isinstance(position, dict) or position.get("format") != POSITION_FORMAT:
        raise StoreError(f"not a sample-store position (format {POSITION_FORMAT}): {str(position)[:200]}")
    if position.get("consumer") != consumer:
        raise StoreError(f"position belongs to consumer {position.get('consumer')!r}, not {consumer!r}")
    writers = {}
    for w, entry in dict(position.get("writers", {})).items():
        if not (isinstance(entry, list) and len(entry) == 3 and all(isinstance(x, int) and x >= 0 for x in entry)):
            raise StoreError(f"bad position entry for writer {w!r}: {entry!r}")
        writers[str(w)] = list(entry)
    step = position.get("step")
    return {
        "format": POSITION_FORMAT,
        "consumer": consumer,
        "step": step if isinstance(step, int) else None,
        "writers": writers,
    }


def read_position(path: Path, consumer: str) -> dict[str, Any] | None:
    """A position file, or None if it does not exist; :class:`StoreError` naming the file if it is unreadable."""
    try:
        data = read_json(path, default=None)
    except (OSError, ValueError) as exc:
        raise StoreError(f"cannot read position file {path}: {getattr(exc, 'reason', exc)}") from None
    return _checked_position(data, consumer, path)


def read_planned(path: Path, consumer: str) -> dict[str, Any] | None:
    """The planned position ``path`` gives (a position file, or a link to the plan that ends with it), or None if it
    is missing or unreadable: it only steers writers' backlog, and a crash of the machine may leave it torn."""
    try:
        data = read_json(path, default=None)
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and "position_after" in data:
        data = data["position_after"]
    return _checked_position(data, consumer, path)


def _checked_position(data: Any, consumer: str, path: Path) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        return check_position(data, consumer)
    except StoreError as exc:
        raise StoreError(f"{path}: {exc}") from None


# ---------------------------------------------------------------------------------------------------- quarantine
def resolve(rd: RunDir, ref: ShardRef) -> Path | None:
    """Where the shard is now: its writer folder, else the quarantine (a reader may have moved it), else None."""
    path = store_paths(rd).shard_file(ref.writer_id, ref.name)
    try:
        os.stat(path)
        return path
    except (FileNotFoundError, NotADirectoryError):
        qpath = rd.quarantine_file(ref.quarantine_name)
        return qpath if qpath.exists() else None


def quarantine(rd: RunDir, ref: ShardRef, reason: str, *, detected_by: str = "") -> bool:
    """Move a corrupt shard to ``samples/quarantine`` with a JSON reason file, logging one warning.

    Safe when several processes detect the same shard: the reason file is rewritten, the first rename wins, and a
    shard that is already in quarantine is left there. Returns True if this call moved the file.
    """
    src = rd.shard_file(ref.writer_id, ref.name)
    dst = rd.quarantine_file(ref.quarantine_name)
    if not src.exists() and dst.exists():
        return False  # already quarantined (by another reader): keep the first reason
    record = {
        "shard": ref.rel,
        "reason": reason,
        "time": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "detected_by": detected_by,
        "num_samples": ref.num_samples,
        "num_groups": ref.num_groups,
    }
    with contextlib.suppress(OSError):
        rd.quarantine.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write_json(rd.quarantine_file(f"{ref.quarantine_name}.reason.json"), record)
    except Exception as exc:
        log.error("cannot write the quarantine reason for %s: %s", src, exc)
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        log.info("corrupt shard %s was quarantined by another reader meanwhile: %s", src, reason)
        return False
    except OSError as exc:
        log.error("cannot move corrupt shard %s to %s: %s (%s)", src, dst, exc, reason)
        return False
    log.warning("quarantined corrupt shard %s -> %s: %s", src, dst, reason)
    return True
