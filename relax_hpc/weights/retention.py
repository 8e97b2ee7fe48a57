"""Which snapshots stay: the last K, pinned versions, LATEST, and any version a live reader holds a lease on.

A lease is ``weights/leases/<reader>.json`` = ``{"reader", "version", "expires", "host", "pid", "time"}``, written
atomically by the reader before it loads and removed after; an expired lease is ignored. A pin is the file
``weights/pins/vNNNNNN`` (its content is a free-form reason).

Deletion never races a reader silently: the publisher renames the folder to a ``.tmp-`` name first, reads the leases
again, and renames it back if a lease for that version appeared meanwhile. A reader takes its lease *before* it checks
that the folder exists, so either the publisher sees the lease, or the reader sees the folder gone and moves on to
a newer version.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import time

from relax_hpc.errors import SnapshotError
from relax_hpc.fsio import atomic_write_json, atomic_write_text, read_json, tmp_name
from relax_hpc.rundir import RunDir
from relax_hpc.weights.delta import base_of
from relax_hpc.weights.manifest import MANIFEST, complete_versions, latest_version, version_of

log = logging.getLogger(__name__)

_READER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def check_reader_name(name: str) -> str:
    """A reader name is used as a file name: letters, digits, ``_ . -``."""
    if not _READER_RE.match(name):
        raise ValueError(f"reader name must be letters, digits, '_', '.', '-', got {name!r}")
    return name


def take_lease(rd: RunDir, reader: str, version: int, lease_s: float) -> None:
    """Declare that ``reader`` is loading ``version`` until ``now + lease_s``."""
    now = time.time()
    atomic_write_json(rd.weight_lease(reader), {"reader": reader, "version": version, "expires": now + lease_s,
                                                "host": socket.gethostname(), "pid": os.getpid(), "time": now},
                      fsync=False, indent=None)


def drop_lease(rd: RunDir, reader: str) -> None:
    """Remove ``reader``'s lease (no error if it is gone)."""
    rd.weight_lease(reader).unlink(missing_ok=True)


def live_leases(rd: RunDir, now: float | None = None) -> dict[int, list[str]]:
    """version -> names of readers holding an unexpired lease on it. Unreadable lease files are skipped."""
    now = time.time() if now is None else now
    out: dict[int, list[str]] = {}
    try:
        paths = list(rd.weight_leases.glob("*.json"))
    except OSError:
        return out
    for p in paths:
        if p.name.startswith("."):
            continue
        try:
            rec = read_json(p)
            version, expires = int(rec["version"]), float(rec["expires"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if expires > now:
            out.setdefault(version, []).append(str(rec.get("reader", p.stem)))
    return out


def pin(rd: RunDir, version: int, reason: str = "") -> None:
    """Keep ``version`` whatever retention says, until :func:`unpin`."""
    rd.weight_pins.mkdir(parents=True, exist_ok=True)
    atomic_write_text(rd.weight_pin(version), reason)


def unpin(rd: RunDir, version: int) -> None:
    """Remove a pin (no error if there is none)."""
    rd.weight_pin(version).unlink(missing_ok=True)


def pinned_versions(rd: RunDir) -> set[int]:
    """Every pinned version."""
    try:
        names = [p.name for p in rd.weight_pins.iterdir()]
    except FileNotFoundError:
        return set()
    return {v for v in (version_of(n) for n in names) if v is not None}


def _base_needed(rd: RunDir, version: int) -> int | None:
    """The base version snapshot ``version`` is a delta of (None: full, or its manifest unreadable)."""
    try:
        return base_of(read_json(rd.snapshot(version) / MANIFEST))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def apply_retention(rd: RunDir, keep_last: int) -> list[int]:
    """Delete complete snapshots that are not among the last ``keep_last``, pinned, LATEST or leased.

    Returns the versions deleted. Meant to be run by the single publisher (the trainer leader).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    versions = complete_versions(rd)
    keep = set(versions[-keep_last:]) | pinned_versions(rd)
    latest = latest_version(rd)
    if latest is not None:
        keep.add(latest)
    leased = live_leases(rd)
    for v in sorted(keep | set(leased)):  # a kept delta keeps its base (a full version: no chains)
        base = _base_needed(rd, v)
        if base is not None:
            keep.add(base)
    removed = []
    for v in versions:
        if v in keep or v in leased:
            continue
        folder = rd.snapshot(v)
        trash = tmp_name(folder)
        try:
            os.rename(folder, trash)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise SnapshotError(f"cannot remove old snapshot {folder}: {exc.strerror or exc}") from exc
        fresh = live_leases(rd)
        if v in fresh or any(_base_needed(rd, x) == v for x in fresh):  # leased meanwhile (or a delta of it is)
            os.rename(trash, folder)
            continue
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(v)
    if removed:
        log.info("retention removed snapshots %s from %s", removed, rd.weights)
    return removed
