"""The weight fast path: new weights go from trainer rank 0 to each rollout worker over a process group.

One group per worker (``weights-<rank>``, world size 2, formed through the run dir by :mod:`relax_hpc.rendezvous`;
gloo on CPU, NCCL on GPU), so a worker that dies or lags only affects its own link. On the trainer a daemon thread per
worker serves it: it waits for the worker's request (the version the worker holds), answers with the newest version
the trainer has handed to :meth:`FastPathServer.update`, and if that is newer broadcasts the weights in buckets
(:func:`relax_hpc.rendezvous.broadcast_state_dict`) straight into the worker's parameters. Any failure closes the
link on both sides; the worker then loads the snapshot from the run dir (the files stay the truth: for recovery,
late joiners and the monitor) and re-forms the link later. The trainer keeps one extra copy of the weights for
the serving threads, so serving never blocks or races with the next optimizer step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from relax_hpc.rundir import RunDir

log = logging.getLogger(__name__)


def link_name(worker: int) -> str:
    return f"weights-{worker}"


class FastPathServer:
    """Trainer side: serve the newest weights to rollout workers ``0..num_workers-1``."""

    def __init__(self, run_dir: RunDir, num_workers: int, *, device: str = "cpu", timeout_s: float = 600.0,
                 bucket_bytes: int = 256 << 20):
        self.run_dir = run_dir
        self.device = device
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self._latest: tuple[int, dict[str, Any]] | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.sent: dict[int, int] = {}
        """worker -> number of weight transfers served (for tests and metrics)."""
        self._served: set[int] = set()
        for k in range(num_workers):
            self._start(k)
        # workers added later (``relax-hpc scale``) get a link too: watch the rollout heartbeats for new ranks
        threading.Thread(target=self._watch, name="fastpath-watch", daemon=True).start()

    def _start(self, worker: int) -> None:
        self._served.add(worker)
        threading.Thread(target=self._serve, args=(worker,), name=f"fastpath-{worker}", daemon=True).start()

    def _watch(self, interval_s: float = 2.0) -> None:
        while not self._stop.wait(interval_s):
            try:
                names = [p.stem for p in self.run_dir.heartbeats.glob("rollout-*.json")]
            except OSError:
                continue
            for name in names:
                rank = name.rpartition("-")[2]
                if rank.isdigit() and int(rank) not in self._served:
                    log.info("fast path: new rollout worker %s, serving it", name)
                    self._start(int(rank))

    def update(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Hand over the weights of ``version`` (copied, so the trainer may keep training)."""
        import torch

        with torch.no_grad():
            copy = {k: v.detach().to(self.device, copy=True) for k, v in state_dict.items()}
        with self._cond:
            self._latest = (version, copy)
            self._cond.notify_all()

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def _serve(self, worker: int) -> None:
        import torch

        from relax_hpc.rendezvous import broadcast_state_dict, form_group

        while not self._stop.is_set():
            try:
                group = form_group(self.run_dir, link_name(worker), rank=0, world_size=2, device=self.device,
                                   timeout_s=self.timeout_s)
            except Exception as exc:  # nobody joined in time: publish a new generation and wait again
                log.debug("fast path to rollout-%d not formed: %s", worker, exc)
                continue
            log.info("fast path to rollout-%d formed (generation %d)", worker, group.generation)
            try:
                while not self._stop.is_set():
                    req = torch.zeros(1, dtype=torch.int64, device=group.device)
                    group.broadcast(req, src=1)  # the worker asks, telling the version it holds
                    with self._cond:
                        latest = self._latest
                    have = int(req.item())
                    version = latest[0] if latest is not None and latest[0] > have else -1
                    hdr = torch.tensor([version], dtype=torch.int64, device=group.device)
                    group.broadcast(hdr, src=0)
                    if version >= 0 and latest is not None:
                        broadcast_state_dict(group, latest[1], src=0, bucket_bytes=self.bucket_bytes)
                        self.sent[worker] = self.sent.get(worker, 0) + 1
            except Exception as exc:
                log.info("fast path to rollout-%d closed: %s", worker, str(exc).splitlines()[0] if str(exc) else exc)
            finally:
                group.close()


class FastPathClient:
    """Rollout-worker side: pull newer weights into a model over the link, or report that the files must be used."""

    def __init__(self, run_dir: RunDir, worker: int, *, device: str = "cpu", join_timeout_s: float = 10.0,
                 timeout_s: float = 600.0, retry_s: float = 60.0):
        self.run_dir = run_dir
        self.worker = worker
        self.device = device
        self.join_timeout_s = join_timeout_s
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._group: Any = None
        self._next_try = 0.0
        self._min_generation = 0

    def _connect(self) -> bool:
        if self._group is not None:
            return True
        if time.monotonic() < self._next_try:
            return False
        from relax_hpc.rendezvous import form_group

        try:
            self._group = form_group(self.run_dir, link_name(self.worker), rank=1, world_size=2,
                                     device=self.device, timeout_s=self.join_timeout_s,
                                     min_generation=self._min_generation)
            self._min_generation = self._group.generation + 1
            return True
        except Exception as exc:
            log.info("fast path not available (%s); using weight snapshots", str(exc).splitlines()[0])
            self._next_try = time.monotonic() + self.retry_s
            return False

    def pull(self, have_version: int, target: Any) -> int | None:
        """Ask for weights newer than ``have_version``; copy them into ``target`` (module or state dict) in place.

        Returns the version received, ``have_version`` if the trainer has nothing newer, or None if the link is
        down (load the snapshot from the run dir instead).
        """
        import torch

        from relax_hpc.rendezvous import broadcast_state_dict

        if not self._connect():
            return None
        g = self._group
        try:
            g.broadcast(torch.tensor([have_version], dtype=torch.int64, device=g.device), src=1)
            hdr = torch.zeros(1, dtype=torch.int64, device=g.device)
            g.broadcast(hdr, src=0)
            version = int(hdr.item())
            if version < 0:
                return have_version
            sd = target.state_dict() if hasattr(target, "state_dict") else target
            broadcast_state_dict(g, sd, src=0)
            return version
        except Exception as exc:
            log.info("fast path broke (%s); using weight snapshots", str(exc).splitlines()[0] if str(exc) else exc)
            self.close()
            self._next_try = time.monotonic() + 1.0
            return None

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None
