"""Incremental readers of JSON-lines files that other processes are still writing.

A :class:`JsonlTail` remembers how far it has read one file; each :meth:`~JsonlTail.read` returns only the records
appended since. A last line without its newline (a writer caught mid-``write``, or an NFS client that has not seen
the rest yet) is kept and completed by a later read, never parsed half. A line that is complete but not JSON (a
killed writer's fragment, which :class:`relax_hpc.events.EventLog` ends with a newline when it restarts) is counted
in ``bad_lines`` and skipped. A file that shrinks or is replaced (new inode) is read again from the start.

A :class:`DirTail` tails every ``*.jsonl`` file of a folder, picking up files that appear later.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

CHUNK_BYTES = 16 << 20
"""Largest read in one go; a first read of a big file loops over chunks of this size."""


_decode = json.JSONDecoder().decode
METRICS_MARK = '"kind": "metrics"'
"""How :class:`relax_hpc.events.EventLog` spells a metrics record near the start of its line."""


class JsonlTail:
    """Incremental reader of one JSON-lines file (which may not exist yet).

    ``skip``: lines holding this text in their first 80 characters are counted in ``skipped`` and not parsed
    (the monitor skips rollout workers' metrics lines this way, which halves a first read), unless they hold
    ``keep`` (anywhere: the decode metrics of a worker's in-process engine).
    """

    def __init__(self, path: Path | str, *, skip: str | None = None, keep: str | None = None):
        self.path = Path(path)
        self.skip = skip
        self.keep = keep
        self.offset = 0
        """Bytes consumed so far (the pending partial line included)."""
        self.bad_lines = 0
        """Complete lines that were not a JSON object."""
        self.lines = 0
        """Records returned so far."""
        self.skipped = 0
        """Lines not parsed because of ``skip``."""
        self._pending = b""
        self._ino: int | None = None

    def _reset(self) -> None:
        self.offset = 0
        self._pending = b""

    def read(self) -> list[dict[str, Any]]:
        """Records appended since the last call (empty if the file is missing or unchanged)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return []
        if self._ino is not None and (st.st_ino != self._ino or st.st_size < self.offset):
            self._reset()  # replaced or truncated: start over
        self._ino = st.st_ino
        if st.st_size == self.offset:
            return []
        out: list[dict[str, Any]] = []
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                while True:
                    data = f.read(CHUNK_BYTES)
                    if not data:
                        break
                    self.offset += len(data)
                    out.extend(self._parse(data))
        except OSError:
            return out
        return out

    def _parse(self, data: bytes) -> Iterator[dict[str, Any]]:
        if self._pending:
            data = self._pending + data
        complete, newline, self._pending = data.rpartition(b"\n")
        if not newline:  # no complete line yet: everything is pending
            self._pending = complete + self._pending
            return
        skip = self.skip
        for line in complete.decode("utf-8", errors="replace").split("\n"):
            if not line or line.isspace():
                continue
            if skip is not None and skip in line[:80] and (self.keep is None or self.keep not in line):
                self.skipped += 1
                continue
            try:
                rec = _decode(line)
            except ValueError:
                self.bad_lines += 1
                continue
            if not isinstance(rec, dict):
                self.bad_lines += 1
                continue
            self.lines += 1
            yield rec

    @property
    def pending_bytes(self) -> int:
        """Length of the incomplete last line held back for the next read."""
        return len(self._pending)


class DirTail:
    """Tails every ``*.jsonl`` file in a folder (created later or not), keyed by file stem (the proc name).

    ``skip`` maps a stem to the ``skip`` text of its :class:`JsonlTail` (None: parse every line); ``keep`` is every
    tail's ``keep``.
    """

    def __init__(self, folder: Path | str, *, skip: Callable[[str], str | None] | None = None,
                 keep: str | None = None):
        self.folder = Path(folder)
        self.skip = skip
        self.keep = keep
        self.tails: dict[str, JsonlTail] = {}

    def discover(self) -> None:
        """Start tailing files that appeared since the last call (one directory listing)."""
        try:
            entries = os.scandir(self.folder)
        except OSError:
            return
        with entries:
            for e in entries:
                name = e.name
                if name.endswith(".jsonl") and not name.startswith(".") and name[:-6] not in self.tails:
                    stem = name[:-6]
                    self.tails[stem] = JsonlTail(e.path, skip=self.skip(stem) if self.skip else None,
                                                 keep=self.keep)

    def read(self) -> list[tuple[str, dict[str, Any]]]:
        """``(stem, record)`` pairs appended to any file since the last call, file by file."""
        self.discover()
        out: list[tuple[str, dict[str, Any]]] = []
        for stem, tail in self.tails.items():
            out.extend((stem, rec) for rec in tail.read())
        return out

    @property
    def bad_lines(self) -> int:
        return sum(t.bad_lines for t in self.tails.values())

    @property
    def lines(self) -> int:
        """Lines read (parsed or skipped)."""
        return sum(t.lines + t.skipped for t in self.tails.values())
