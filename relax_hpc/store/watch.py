"""Cheap change detection for the polling loops of the fully-async roles.

A trainer waiting for samples and a rollout worker waiting for room both poll the run dir. A full look (listing the
writers' shard folders, reading the planned position) costs about a millisecond, so polling it every millisecond
keeps a core busy, and polling it every 5 ms adds ~2.5 ms of reaction time to every step. Instead a poll first
``stat``s a few paths (microseconds each): the samples folder, each writer's shard folder (a published shard is a
rename into it), the planned position and ``weights/LATEST`` (both replaced by rename). Only when one of them
changed, or ``max_age_s`` passed since the last full look, is the full look done. The fallback matters where
attribute caches or coarse timestamps hide a change (NFS ``actimeo``, whole-second directory times).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from relax_hpc.rundir import RunDir

Stamp = tuple[int, int, int]


def _stamp(path: str) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, -1)
    return (st.st_mtime_ns, st.st_ino, st.st_size)


class ChangeWatch:
    """``changed()`` is True when the stat of any watched path differs from the previous call, or when
    ``max_age_s`` passed since it last returned True (the first call is always True)."""

    def __init__(self, paths: Callable[[], list[str]], *, max_age_s: float = 0.05):
        self._paths = paths
        self.max_age_s = max_age_s
        self._last: dict[str, Stamp] | None = None
        self._checked = 0.0

    def changed(self) -> bool:
        now = time.monotonic()
        stamps = {p: _stamp(p) for p in self._paths()}
        if stamps != self._last or now - self._checked >= self.max_age_s:
            self._last, self._checked = stamps, now
            return True
        return False


def samples_watch(rd: RunDir, *, max_age_s: float = 0.05) -> ChangeWatch:
    """Changes when a shard is published (by any writer) or a new writer appears. Where the run dir has the
    announcement index, two stats a poll (the shards folder and ``samples/announce``, where every publish creates a
    name), whatever the number of writers; else the shards folder and every writer folder. A shard published
    without its announcement is seen by the ``max_age_s`` fallback."""
    root = str(rd.shards)
    announce = str(rd.announce)
    writers: list[str] = []
    root_stamp: list[Stamp] = []
    indexed: list[bool] = []

    def paths() -> list[str]:
        if indexed or os.path.isdir(announce):
            indexed[:] = [True]
            return [root, announce]
        stamp = _stamp(root)
        if [stamp] != root_stamp:  # a writer folder came or went: list them again
            root_stamp[:] = [stamp]
            try:
                writers[:] = [os.path.join(root, e.name) for e in os.scandir(root) if e.is_dir()]
            except OSError:
                writers[:] = []
        return [root, *writers]

    return ChangeWatch(paths, max_age_s=max_age_s)


def files_watch(*files: Path, max_age_s: float = 0.05) -> ChangeWatch:
    """Changes when any of ``files`` is replaced or written (e.g. the planned position, ``weights/LATEST``)."""
    names = [str(f) for f in files]
    return ChangeWatch(lambda: names, max_age_s=max_age_s)
