"""Atomic filesystem primitives for shared filesystems (Lustre, GPFS, NFS, local).

Rules every writer in relax-hpc follows:

* A file is written under a temporary name in the *same folder* (so the rename stays on one filesystem), flushed,
  fsynced, then renamed over its final name. Readers never see a partial file.
* A directory is published by writing its content under a temporary name, writing a completion marker
  (``COMPLETE``) *last*, fsyncing, and renaming the directory into place. A directory without the marker is debris.
* Correctness never depends on file locks (Lustre needs ``-o flock``, NFS locks are fragile). :func:`optional_lock`
  exists only for optimisations and always has a timeout.
* Every wait has a timeout and logs what it waits for (:func:`wait_for`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any, TypeVar

from relax_hpc.errors import RunDirError, StateFileError, WaitTimeout

log = logging.getLogger(__name__)

T = TypeVar("T")

COMPLETE_MARKER = "COMPLETE"
TMP_PREFIX = ".tmp-"


def tmp_name(final: Path) -> Path:
    """A unique temporary sibling of ``final`` (same folder, so ``os.replace`` is atomic)."""
    return final.with_name(f"{TMP_PREFIX}{final.name}.{socket.gethostname()}.{os.getpid()}.{time.monotonic_ns()}")


def check_writable(folder: Path | str, what: str = "folder") -> None:
    """Raise :class:`RunDirError` naming ``folder`` unless a file can be created in it (read-only mounts, missing
    permissions, a full disk): checked before a command starts anything, so nothing is left half done."""
    folder = Path(folder)
    probe = tmp_name(folder / ".write-check")
    try:
        with open(probe, "wb"):
            pass
        probe.unlink()
    except OSError as exc:
        raise RunDirError(f"{what} {oserror_message(exc, folder)}") from None


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it is durable. Ignored where the filesystem does not support it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def oserror_message(exc: OSError, path: Path) -> str:
    reason = {errno.ENOSPC: "no space left on device", errno.EROFS: "read-only filesystem",
              errno.EACCES: "permission denied", errno.EDQUOT: "disk quota exceeded"}.get(exc.errno or 0)
    return f"cannot write {path}: {reason or exc.strerror or exc}"


def atomic_write_bytes(path: Path | str, data: bytes, *, fsync: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically (tmp + fsync + rename). On failure nothing at ``path`` changes.

    Raises :class:`RunDirError` naming the file on a full disk, a read-only folder or a permission problem.
    """
    path = Path(path)
    tmp = tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise RunDirError(oserror_message(exc, path)) from exc
    if fsync:
        fsync_dir(path.parent)
    return path


def atomic_write_text(path: Path | str, text: str, *, fsync: bool = True) -> Path:
    """Atomically write UTF-8 text."""
    return atomic_write_bytes(path, text.encode(), fsync=fsync)


def atomic_write_json(path: Path | str, obj: Any, *, fsync: bool = True, indent: int | None = 1) -> Path:
    """Atomically write ``obj`` as JSON (the only structured format besides HDF5 and safetensors; never pickle)."""
    return atomic_write_bytes(path, (json.dumps(obj, indent=indent, sort_keys=False, default=str) + "\n").encode(),
                              fsync=fsync)


def create_marker(path: Path | str) -> bool:
    """Create the empty file ``path`` with ``O_CREAT | O_EXCL`` (atomic on local filesystems, NFSv3+, Lustre and
    SFTP mounts: the name appears once, with nothing in it to be torn). False if it existed already.

    Raises :class:`RunDirError` naming the file on a full disk, a read-only folder or a permission problem.
    """
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError as exc:
        raise RunDirError(oserror_message(exc, Path(path))) from exc
    os.close(fd)
    return True


def _why_unreadable(data: bytes, exc: Exception) -> str:
    if data[:1] == b"\x80" and data[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "it holds a Python pickle, not JSON (never unpickled)"
    if not data.strip():
        return "it is empty (truncated?)"
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start})"
    if isinstance(exc, json.JSONDecodeError):
        end = "truncated? " if exc.pos >= len(data.rstrip()) else ""
        return f"not valid JSON ({end}{exc.msg} at line {exc.lineno}, column {exc.colno})"
    return f"not valid JSON ({type(exc).__name__})"


def read_json(path: Path | str, default: Any = ..., *, expect: type | tuple[type, ...] | None = None) -> Any:
    """Read a JSON file written by :func:`atomic_write_json`. ``default`` is returned if it does not exist.

    The single reader of run-dir state files: a file that exists but is garbage, truncated, empty, not UTF-8, a
    pickle, unreadable, or (with ``expect``) of the wrong JSON type raises :class:`StateFileError` naming it.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        if default is ...:
            raise
        return default
    except OSError as exc:
        raise StateFileError(path, exc.strerror or str(exc)) from exc
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise StateFileError(path, _why_unreadable(data, exc)) from None
    if expect is not None and not isinstance(obj, expect):
        want = " or ".join(t.__name__ for t in (expect if isinstance(expect, tuple) else (expect,)))
        raise StateFileError(path, f"expected a JSON {want.replace('dict', 'object').replace('list', 'array')}, "
                                   f"got {type(obj).__name__}")
    return obj


@contextlib.contextmanager
def staged_dir(final: Path | str, *, marker: str = COMPLETE_MARKER, marker_content: str = "",
               durable: Collection[str] = ()) -> Iterator[Path]:
    """Build a directory under a temporary name and publish it atomically when the block exits cleanly.

    Inside the block, write files into the yielded folder. On exit every file is fsynced, the ``marker`` file is
    written last, and the folder is renamed to ``final`` (which must not exist yet). On an exception the temporary
    folder is removed and ``final`` is untouched. ``durable``: paths (relative to the folder) whose data the caller
    already made durable (fsynced, or hard-linked from a published folder); read on exit, so the block may add to
    it; they are not fsynced again (the folder's own fsync still covers their names).
    """
    final = Path(final)
    tmp = tmp_name(final)
    try:
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise RunDirError(oserror_message(exc, tmp)) from exc
    try:
        yield tmp
        publish_dir(tmp, final, marker=marker, marker_content=marker_content, durable=durable)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise RunDirError(oserror_message(exc, final)) from exc
        raise


def publish_dir(tmp: Path, final: Path, *, marker: str = COMPLETE_MARKER, marker_content: str = "",
                durable: Collection[str] = ()) -> None:
    """Publish the filled folder ``tmp`` as ``final`` (which must not exist yet): every file fsynced (but those
    named in ``durable``, see :func:`staged_dir`), the ``marker`` written last, one rename (what :func:`staged_dir`
    does on exit; for a folder several processes filled)."""
    for p in tmp.rglob("*"):
        if p.is_file() and p.relative_to(tmp).as_posix() not in durable:
            fsync_file(p)
    atomic_write_text(tmp / marker, marker_content)
    fsync_dir(tmp)
    if final.exists():
        raise RunDirError(f"cannot publish {final}: it already exists")
    os.rename(tmp, final)
    fsync_dir(final.parent)


def fsync_file(path: Path) -> None:
    """Flush the file ``path``'s data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_complete(path: Path | str, marker: str = COMPLETE_MARKER) -> bool:
    """True if the directory was published by :func:`staged_dir` (its marker exists)."""
    return (Path(path) / marker).is_file()


def remove_debris(folder: Path | str, *, older_than_s: float = 3600.0) -> list[Path]:
    """Delete temporary files/folders (``.tmp-*``) older than ``older_than_s`` left by killed writers."""
    removed: list[Path] = []
    now = time.time()
    folder = Path(folder)
    if not folder.is_dir():
        return removed
    for p in folder.iterdir():
        if not p.name.startswith(TMP_PREFIX):
            continue
        try:
            age = now - p.lstat().st_mtime
        except FileNotFoundError:
            continue
        if age < older_than_s:
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        removed.append(p)
    if removed:
        log.info("removed %d debris entries from %s", len(removed), folder)
    return removed


def refresh_nfs_cache(path: Path | str) -> None:
    """Nudge NFS attribute caches before polling for a file another node wrote (as submitit does).

    Listing the parent folder forces a fresh READDIR on NFS; harmless elsewhere.
    """
    parent = Path(path).parent
    with contextlib.suppress(OSError):
        os.listdir(parent)


def wait_for(
    predicate: Callable[[], T | None],
    *,
    what: str,
    timeout_s: float,
    poll_s: float = 0.05,
    max_poll_s: float = 1.0,
    log_every_s: float = 30.0,
    logger: logging.Logger | None = None,
    backoff_after_s: float = 0.0,
) -> T:
    """Poll ``predicate`` until it returns something truthy, with exponential backoff up to ``max_poll_s``
    (starting after ``backoff_after_s``: short waits are answered within ``poll_s``).

    Logs ``waiting for <what>`` once at the start and every ``log_every_s``; raises :class:`WaitTimeout` naming
    ``what`` after ``timeout_s``.
    """
    logger = logger or log
    start = time.monotonic()
    next_log = start + log_every_s
    delay = poll_s
    first = True
    while True:
        result = predicate()
        if result:
            return result
        now = time.monotonic()
        if first:
            logger.debug("waiting for %s (timeout %.0fs)", what, timeout_s)
            first = False
        if now - start >= timeout_s:
            raise WaitTimeout(f"timed out after {timeout_s:.0f}s waiting for {what}")
        if now >= next_log:
            logger.info("still waiting for %s (%.0fs of %.0fs)", what, now - start, timeout_s)
            next_log = now + log_every_s
        time.sleep(min(delay, max(0.0, timeout_s - (now - start))))
        if now - start >= backoff_after_s:
            delay = min(delay * 1.5, max_poll_s)


@contextlib.contextmanager
def optional_lock(path: Path | str, *, timeout_s: float = 10.0) -> Iterator[bool]:
    """A best-effort file lock (filelock) for optimisations only. Yields False if it could not be taken in time.

    Code using it must stay correct when the lock is not held (Lustre without ``-o flock``, flaky NFS locks).
    """
    from filelock import FileLock, Timeout

    lock = FileLock(str(path), timeout=timeout_s)
    try:
        lock.acquire()
    except (Timeout, OSError):
        yield False
        return
    try:
        yield True
    finally:
        lock.release()
