"""A rollout worker's weight pick-up through the engine's sink: the fast path first, the snapshot files the truth.

:class:`FastPathStream` adapts the fast path's client (:class:`relax_hpc.weights.fastpath.FastPathClient`) to a
:class:`~relax_hpc.rollout.engine.BucketStream`: :meth:`FastPathStream.fetch` receives the newest version into
buffers shaped like the engine's weights (:meth:`RolloutEngine.weight_template`), and the engine copies the buckets
into its own weights in :meth:`~RolloutEngine.receive` (so a broken link never leaves the engine half updated).
:class:`WeightSync` loads the newest complete snapshot folder (under a lease, so retention keeps it meanwhile) or
pulls over the fast path, both through ``engine.receive``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from relax_hpc.rollout.engine import BucketStream, RolloutEngine, SnapshotFolder
from relax_hpc.rundir import RunDir

log = logging.getLogger(__name__)


class FastPathStream(BucketStream):
    """The fast path as a bucket stream: :meth:`fetch` a version, then hand the stream to ``engine.receive``."""

    def __init__(self, client: Any, template: Mapping[str, Any], *, bucket_bytes: int = 256 << 20):
        import torch

        from relax_hpc.rendezvous import bucket_names

        self.client = client
        with torch.no_grad():
            self._buffers = {k: torch.empty_like(v.detach(), device=client.device) for k, v in template.items()}
        self._names = bucket_names(self._buffers, bucket_bytes)
        self.version: int | None = None
        """The version the buffers hold (None before the first fetch)."""

    def fetch(self, have_version: int) -> int | None:
        """Receive weights newer than ``have_version`` if the trainer has any (does not wait for new ones).
        Returns the version now held (``have_version`` when nothing newer came), or None when the link is down or
        does not match (use the files)."""
        got = self.client.pull(have_version, self._buffers)
        if got is not None and got > have_version:
            self.version = got
        return got

    def buckets(self) -> Iterator[dict[str, Any]]:
        for names in self._names:
            yield {n: self._buffers[n] for n in names}

    def close(self) -> None:
        self.client.close()


class StateDictStream(BucketStream):
    """A full state dict (``{hf_name: tensor}``) as one bucket: the hand-over of a trainer's weights to an engine in
    the same process that cannot share the trainer's module."""

    def __init__(self, state: Mapping[str, Any]):
        self.state = dict(state)

    def buckets(self) -> Iterator[dict[str, Any]]:
        yield self.state


class WeightSync:
    """Loads new weights into ``engine``: over the fast path when there is one (a :class:`FastPathStream`, or for a
    server engine a :class:`relax_hpc.rollout.server.fastpath.ServerFastPath`), else from the run dir's files."""

    def __init__(self, run_dir: RunDir, engine: RolloutEngine, *, reader: str,
                 verify: Literal["sha256", "size", "none"] = "sha256", fast: Any = None,
                 lease_s: float = 900.0, attempts: int = 20):
        from relax_hpc.weights.retention import check_reader_name

        self.run_dir = run_dir
        self.engine = engine
        self.reader = check_reader_name(reader)
        self.verify = verify
        self.fast = fast
        self.lease_s = lease_s
        self.attempts = attempts

    def newest(self) -> int | None:
        from relax_hpc.weights import latest_version

        return latest_version(self.run_dir)

    async def load_files(self, version: int | None = None) -> int:
        """Load the newest complete snapshot (or snapshot ``version``) into the engine; its version. A snapshot can
        be retired between reading LATEST and taking the lease when the trainer publishes fast: then look again
        (bounded); a named version that is gone is a :class:`~relax_hpc.errors.SnapshotError`."""
        from relax_hpc.errors import SnapshotError
        from relax_hpc.fsio import is_complete

        last: Exception | None = None
        for _ in range(self.attempts if version is None else 1):
            v = self.newest() if version is None else version
            if v is None:
                raise SnapshotError(f"no weight snapshot in {self.run_dir.weights} yet")
            folder = self.run_dir.snapshot(v)
            self._lease(v)
            try:
                if not is_complete(folder):
                    raise SnapshotError(f"{folder} is not complete")
                await self.engine.receive(v, SnapshotFolder(folder, self.verify))
                return v
            except (SnapshotError, FileNotFoundError) as exc:
                last = exc
            finally:
                self._drop_lease()
            await asyncio.sleep(0.05)
        raise SnapshotError(f"no snapshot could be loaded after {self.attempts} attempts: {last}")

    async def pull_fast(self) -> int | None:
        """Newer weights over the fast path into the engine. Returns the version received, the engine's version
        when nothing newer came, or None when there is no usable link."""
        if self.fast is None:
            return None
        have = self.engine.version
        got = self.fast.fetch(have)
        if got is not None and got > have:
            await self.engine.receive(got, self.fast)
        return got

    async def update(self, *, files_first: bool) -> tuple[int, str]:
        """Bring the engine to the newest version: (version, ``"fast"`` or ``"file"``). ``files_first``: a worker's
        first weights come from the files (a late joiner starts at once)."""
        newest = self.newest()
        if not files_first:
            got = await self.pull_fast()
            if got is not None and newest is not None and got >= newest:
                return got, "fast"
        return await self.load_files(), "file"

    def close(self) -> None:
        if self.fast is not None:
            self.fast.close()

    def _lease(self, version: int) -> None:
        from relax_hpc.errors import RunDirError
        from relax_hpc.weights.retention import take_lease

        try:
            take_lease(self.run_dir, self.reader, version, self.lease_s)
        except RunDirError as exc:  # a read-only mount can still load; retention may race us
            log.debug("cannot take a snapshot lease (%s); loading without one", exc)

    def _drop_lease(self) -> None:
        from relax_hpc.weights.retention import drop_lease

        with contextlib.suppress(OSError):
            drop_lease(self.run_dir, self.reader)
