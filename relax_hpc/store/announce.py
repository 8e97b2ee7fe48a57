"""The announcement index: one empty file per published, unconsumed shard, in one folder.

A writer renames its shard into its own folder (the publish: the shard is then in the store, whatever follows) and
then creates ``samples/announce/<writer_id>.<shard name>`` (:func:`relax_hpc.fsio.create_marker`: ``O_EXCL``, no
content). The trainer's planner lists that one folder for new shards instead of every writer folder, so its cost
grows with the shards it reads, not with the number of writers.

The announcements are a hint, never the truth: a writer killed between its rename and its announcement, an
announcement that could not be created, or a listing served from an attribute cache leaves a published shard
unannounced. The planner therefore lists every writer folder (the truth) on its first plan, every ``full_scan_s``
seconds, whenever a look at the index finds too little data, and, for one writer, whenever that writer's announced
``seq`` do not continue its position without a gap (:class:`relax_hpc.store.consumer.ConsumerGroup`). An
announced shard that is not (or no longer) visible is never counted as lost: the planner waits for a full scan.
Retention removes the announcements of consumed shards with the shards (:func:`remove_consumed`).

A listing can be served from a network client's directory cache for a whole timeout (NFS ``acdirmax``, sshfs
``dcache_timeout``): the new announcements of a cached listing stay hidden. So each writer also replaces its *head*,
``samples/heads/<writer_id>.json``, naming its newest ``HEAD_NAMES`` shards (:func:`write_head`), and the planner
reads the heads of the writers it knows by name (:func:`read_heads`): opening a known name after the writer's
rename gives the new file (close-to-open), whatever the directory cache says. A new writer is still found by a
listing (once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterable
from typing import Any

from relax_hpc.errors import RunDirError
from relax_hpc.fsio import atomic_write_json, create_marker, read_json
from relax_hpc.rundir import RunDir
from relax_hpc.store.layout import ShardRef

log = logging.getLogger("relax_hpc.store")

#: ``<writer_id>.<shard name>`` over names joined by NUL: each match is one whole name.
_ANNOUNCED_RE = re.compile(
    r"(?<![^\0])([A-Za-z0-9][A-Za-z0-9_.-]{0,127})\.(\d{12})\.s(\d+)\.g(\d+)\.v(\d+)-(\d+)\.h5(?![^\0])"
)
Announced = dict[str, list[tuple[int, int, int, int, int]]]
"""Writer id -> announced shards ``(seq, samples, groups, min version, max version)`` in seq order."""


def announce(rd: RunDir, writer_id: str, name: str) -> bool:
    """Announce the published shard ``name`` of ``writer_id``; False (logged) if the announcement could not be
    made: the shard stays published and a full scan finds it."""
    try:
        create_marker(rd.announce_file(writer_id, name))
        return True
    except RunDirError as exc:
        if not rd.announce.is_dir():  # a run dir made before the index existed
            with contextlib.suppress(OSError):
                rd.announce.mkdir(parents=True, exist_ok=True)
                create_marker(rd.announce_file(writer_id, name))
                return True
        log.warning("shard %s/%s is published but not announced (%s); the planner's full scan finds it",
                    writer_id, name, exc)
        return False


HEAD_NAMES = 64
"""A writer's head names its newest shards, up to this many (a planner more shards behind lists the folder)."""


def write_head(rd: RunDir, writer_id: str, names: list[str]) -> None:
    """Replace ``writer_id``'s head with its newest shard names (a hint like the announcements: logged on failure)."""
    try:
        atomic_write_json(rd.head_file(writer_id), {"shards": names[-HEAD_NAMES:]}, fsync=False, indent=None)
    except (OSError, RunDirError) as exc:
        log.warning("head of writer %s not written (%s); the planner's listings find its shards", writer_id, exc)


def read_heads(rd: RunDir, writers: Iterable[str], index: Announced) -> Announced:
    """Add to ``index`` the shards the heads of ``writers`` name (read by name); unreadable heads are skipped."""
    for w in writers:
        try:
            data = read_json(rd.head_file(w), default=None)
        except (OSError, ValueError):
            continue
        names = data.get("shards") if isinstance(data, dict) else None
        if not isinstance(names, list):
            continue
        have = {t[0] for t in index.get(w, ())}
        for name in names:
            ref = ShardRef.parse(w, name) if isinstance(name, str) else None
            if ref is not None and ref.seq not in have:
                index.setdefault(w, []).append((ref.seq, ref.num_samples, ref.num_groups, ref.min_version,
                                                ref.max_version))
                have.add(ref.seq)
        if w in index:
            index[w].sort()
    return index


def list_announced(rd: RunDir) -> tuple[Announced, int]:
    """The announced shards by writer, and how many entries of the folder are not announcements (damaged or
    foreign names: the caller then trusts only a full scan). One listing and one regex pass."""
    try:
        names = os.listdir(rd.announce)
    except FileNotFoundError:
        return {}, 0
    found: Announced = {}
    matches = _ANNOUNCED_RE.findall("\0".join(names))
    for w, q, n, g, lo, hi in matches:
        found.setdefault(w, []).append((int(q), int(n), int(g), int(lo), int(hi)))
    for shards in found.values():
        shards.sort()
    return found, len(names) - len(matches)


def remove_consumed(rd: RunDir, position: dict[str, Any]) -> int:
    """Remove the announcements of shards below ``position`` (consumed); returns how many. Damaged names are left
    for a person to look at (they only make plans scan every writer folder)."""
    try:
        names = os.listdir(rd.announce)
    except FileNotFoundError:
        return 0
    writers = position["writers"]
    n = 0
    for m in _ANNOUNCED_RE.finditer("\0".join(names)):
        entry = writers.get(m.group(1))
        if entry is None or int(m.group(2)) >= entry[0]:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(rd.announce / m.group(0))
            n += 1
    return n
