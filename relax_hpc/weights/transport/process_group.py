"""The ``process_group`` transport (fully_async, in-process engines): trainer rank 0 serves each new version over
a process group per rollout worker (:mod:`relax_hpc.weights.fastpath`); the worker pulls it into buffers shaped
like its engine's weights and the engine copies them in (:class:`~relax_hpc.rollout.weight_sync.FastPathStream`).
The snapshot files are written for every version while some worker is off the link, else at most every
``files_every_s`` seconds (and the last version's always)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from relax_hpc.weights.transport.files import FilesSender, SnapshotFiles

if TYPE_CHECKING:
    from relax_hpc.weights.fastpath import WeightLinks

log = logging.getLogger(__name__)


class LinkSender(FilesSender):
    """Links to the rollout side (on trainer rank 0; ``None`` on the other ranks, which take part in gathering the
    weights) plus the snapshot files."""

    def __init__(self, kind: str, files: SnapshotFiles, links: WeightLinks | None, *, publish_every: int,
                 files_every_s: float):
        super().__init__(files, publish_every=publish_every)
        self.kind = kind
        self.links = links
        self.files_every_s = files_every_s
        self.files_version = self.trainer.step
        """The newest version handed to the snapshot files."""

    def start(self, version: int) -> None:
        sd = self.trainer.full_state_dict()  # every rank: with several ranks gathering the model is a collective
        if self.links is not None:
            self.links.update(version, sd)
        self.files_version = version

    def send(self, version: int, *, final: bool = False) -> None:
        if not self.due(version, final):
            return
        links, files = self.links, self.files
        sd = self.trainer.full_state_dict(copy=links is None)  # every rank (a collective with several)
        if links is None:
            files.submit(version, sd, private=True)
            self.files_version = version
            return
        packed = links.update(version, sd)
        if final or not links.all_linked() or time.monotonic() - files.last_submit >= self.files_every_s:
            files.submit(version, packed.views(), private=True)
            self.files_version = version

    def idle(self) -> None:
        """While the trainer waits for samples: when some worker is off the link (restarted, link down), write the
        files of the newest version if they were skipped (``files_every_s``): a worker that only reads files would
        otherwise generate with weights too old to train on while the trainer waits for it."""
        links = self.links
        if links is None or links.all_linked():
            return
        latest = links.latest()
        if latest is not None and latest[0] > self.files_version:
            log.info("a rollout worker is off the fast path: writing the files of version %d", latest[0])
            self.files.submit(latest[0], latest[1].views(), private=True)
            self.files_version = latest[0]

    def close(self) -> None:
        self.files.close()
        if self.links is not None:
            self.links.close()


def process_group_links(run_dir: Any, num_workers: int, *, backend: str, device: str) -> WeightLinks:
    """Trainer rank 0's links: one process group per rollout worker."""
    from relax_hpc.weights.fastpath import FastPathServer, link_device

    return FastPathServer(run_dir, num_workers, device=link_device(backend, device))
