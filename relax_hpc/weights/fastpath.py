"""The weight fast path: new weights go from trainer rank 0 to each rollout worker over a process group.

One group per worker (``weights-<rank>``, world size 2, formed through the run dir by :mod:`relax_hpc.rendezvous`;
gloo on CPU, NCCL on GPU), so a worker that dies or lags only affects its own link. On the trainer a daemon thread per
worker serves it. The weights of a version are packed once into flat buckets by :meth:`FastPathServer.update`; a
transfer is a header (version, signature of the names, dtypes and shapes) and one message per bucket, which the
worker copies into its parameters.

Two ways to serve, by backend:

* gloo (push): as soon as a new version is handed over, the serving thread announces it in the link's store
  (``version signature``) and sends its buckets, which wait in the link until the worker takes them.
  :meth:`FastPathClient.pull` reads the announcement (the store is served by a C++ thread of the trainer process)
  and receives only when it is newer, so neither asking nor receiving waits for the trainer's busy core and GIL.
  While the thread waits for the worker to take one version it announces no other: the worker takes it and the
  next one comes in its next pull.
* NCCL (request): the worker asks with the version it holds and its signature, the thread answers with the newest
  version (or "nothing newer", or "mismatch") and the buckets. A receive posted in advance would be a GPU kernel
  spinning beside generation, so NCCL waits for the worker's request instead.

Any failure closes the link on both sides; the worker then loads the snapshot from the run dir (the files stay the
truth: for recovery, late joiners and the monitor) and re-forms the link later. The trainer keeps one extra copy of
the weights (the packed one) for the serving threads, so serving never blocks or races with the next optimizer step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from relax_hpc.errors import RelaxError
from relax_hpc.rundir import RunDir

log = logging.getLogger(__name__)


class WeightLinks(Protocol):
    """The trainer's side of a weight fast path (:class:`FastPathServer` to in-process workers,
    :class:`relax_hpc.weights.server_links.ServerLinks` to rollout servers)."""

    def update(self, version: int, state_dict: Mapping[str, Any]) -> PackedWeights:
        """Hand over ``version``; returns its packed copy (whose ``views()`` may go to the snapshot files)."""
        ...

    def all_linked(self) -> bool:
        """Whether every worker takes new weights over the fast path now (else its files must be written)."""
        ...

    def latest(self) -> tuple[int, PackedWeights] | None:
        """The newest version handed over and its packed copy."""
        ...

    def close(self) -> None: ...


def link_name(worker: int) -> str:
    return f"weights-{worker}"


class PackedWeights:
    """A state dict packed into flat byte buckets (:func:`relax_hpc.rendezvous.bucket_names`), with its signature.

    The trainer packs each new version once; a worker keeps one set of receive buffers for its model and unpacks
    them into its parameters in place. Both sides compute the same layout from equal names, dtypes and shapes; the
    signature (which covers ``bucket_bytes`` too) tells whether they do."""

    def __init__(self, state_dict: Mapping[str, Any], *, bucket_bytes: int, device: Any, pack: bool):
        import torch

        from relax_hpc.rendezvous import bucket_names, state_signature

        self.state_dict = state_dict
        self._views: dict[str, Any] | None = None
        self.signature = state_signature(state_dict, bucket_bytes)
        self.names = bucket_names(state_dict, bucket_bytes)
        self.buckets: list[torch.Tensor] = [
            torch.empty(sum(state_dict[n].numel() * state_dict[n].element_size() for n in names), dtype=torch.uint8,
                        device=device)
            for names in self.names]
        if pack:
            views = self.views()
            _copy([views[n] for n in views], [state_dict[n] for n in views])

    def views(self) -> dict[str, Any]:
        """The packed weights as a state dict of views into the buckets (no copy; the buckets never change)."""
        if self._views is None:
            self._views = {}
            for names, flat in zip(self.names, self.buckets):
                off = 0
                for name in names:
                    t = self.state_dict[name]
                    n = t.numel() * t.element_size()
                    self._views[name] = flat[off:off + n].view(t.dtype).view(t.shape)
                    off += n
        return self._views

    def unpack(self) -> None:
        """Copy the buckets into the tensors of the state dict this was made from (in place)."""
        views = self.views()
        _copy([self.state_dict[n] for n in views], [views[n] for n in views])


def _copy(dst: list[Any], src: list[Any]) -> None:
    """``dst[i].copy_(src[i])`` for all i: one foreach copy on one device, else (host <-> GPU) one by one."""
    import torch

    with torch.no_grad():
        if all(d.device == s.device for d, s in zip(dst, src)):
            torch._foreach_copy_(dst, src)
            return
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
        if any(t.is_cuda for t in (*dst, *src)):
            torch.cuda.current_stream().synchronize()


NOTHING_NEWER, MISMATCH = -1, -2
ANNOUNCE_KEY = "announced"
LATEST_KEY = "latest"  # the newest version the trainer has, set when it is handed over (the announced one may lag)


class FastPathServer:
    """Trainer side: serve the newest weights to rollout workers ``0..num_workers-1``."""

    def __init__(self, run_dir: RunDir, num_workers: int, *, device: str = "cpu", timeout_s: float = 600.0,
                 bucket_bytes: int = 256 << 20):
        self.run_dir = run_dir
        self.device = device
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self._latest: tuple[int, PackedWeights] | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.sent: dict[int, int] = {}
        """worker -> number of weight transfers served (for tests and metrics)."""
        self._served: set[int] = set()
        self._linked: dict[int, bool] = {}
        self._groups: dict[int, Any] = {}  # formed push links: told the newest version at once (``LATEST_KEY``)
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

    def all_linked(self) -> bool:
        """Whether every worker this server knows of (configured or seen later) has its link formed now."""
        return all(self._linked.get(k, False) for k in list(self._served))

    def latest(self) -> tuple[int, PackedWeights] | None:
        """The newest version handed over and its packed copy (None before the first)."""
        with self._cond:
            return self._latest

    def _worker_pid(self, worker: int) -> int | None:
        """The pid in the worker's heartbeat (None if there is none or it does not read)."""
        from relax_hpc.fsio import read_json

        try:
            hb = read_json(self.run_dir.heartbeat(f"rollout-{worker}"), default=None)
        except (OSError, ValueError):
            return None
        pid = hb.get("pid") if isinstance(hb, dict) else None
        return pid if isinstance(pid, int) else None

    def update(self, version: int, state_dict: Mapping[str, Any]) -> PackedWeights:
        """Hand over the weights of ``version`` (packed into buckets: a copy, so the trainer may keep training).
        Returns the packed copy (its :meth:`~PackedWeights.views` may be written to the snapshot files)."""
        packed = PackedWeights(state_dict, bucket_bytes=self.bucket_bytes, device=self.device, pack=True)
        with self._cond:
            self._latest = (version, packed)
            self._cond.notify_all()
        for worker, group in list(self._groups.items()):
            if uses_push(str(group.device)):
                try:
                    group.set_key(LATEST_KEY, str(version))
                except Exception as exc:  # the link is going down: its serving thread notices
                    log.debug("fast path to rollout-%d: newest version not set: %s", worker, exc)
        return packed

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def _serve(self, worker: int) -> None:
        from relax_hpc.rendezvous import form_group

        while not self._stop.is_set():
            try:
                group = form_group(self.run_dir, link_name(worker), rank=0, world_size=2, device=self.device,
                                   timeout_s=self.timeout_s)
            except Exception as exc:  # nobody joined in time: publish a new generation and wait again
                log.debug("fast path to rollout-%d not formed: %s", worker, exc)
                continue
            log.info("fast path to rollout-%d formed (generation %d)", worker, group.generation)
            self._linked[worker] = True
            self._groups[worker] = group
            try:
                (self._push if uses_push(str(group.device)) else self._answer)(worker, group)
            except Exception as exc:
                log.info("fast path to rollout-%d closed: %s", worker, str(exc).splitlines()[0] if str(exc) else exc)
            finally:
                self._linked[worker] = False
                self._groups.pop(worker, None)
                group.close()

    def _push(self, worker: int, group: Any) -> None:
        """gloo: announce and send every new version as soon as it is handed over (the newest at that time). A
        link idle between versions learns that its worker was restarted (a new pid in its heartbeat: the old
        process died without closing the link) and closes, so the link forms again and the files serve meanwhile."""
        sent = -1
        pid = self._worker_pid(worker)
        while not self._stop.is_set():
            with self._cond:
                while not self._stop.is_set() and (self._latest is None or self._latest[0] <= sent):
                    self._cond.wait(timeout=1.0)
                    now = self._worker_pid(worker)
                    if pid is None:
                        pid = now
                    elif now is not None and now != pid:
                        raise ConnectionError(f"rollout-{worker} restarted (pid {pid} -> {now})")
                latest = self._latest
            if self._stop.is_set() or latest is None:
                return
            group.set_key(ANNOUNCE_KEY, f"{latest[0]} {latest[1].signature}")
            for flat in latest[1].buckets:
                group.broadcast(flat, src=0)  # returns when the worker took it (or the link failed)
            sent = latest[0]
            self.sent[worker] = self.sent.get(worker, 0) + 1

    def _answer(self, worker: int, group: Any) -> None:
        """NCCL: wait for the worker's request, answer with the newest version (or none, or a mismatch)."""
        import torch

        req = torch.zeros(2, dtype=torch.int64, device=group.device)
        hdr = torch.zeros(1, dtype=torch.int64, device=group.device)
        while not self._stop.is_set():
            group.broadcast(req, src=1)  # the worker asks: [version it holds, signature of its weights]
            have, signature = req.tolist()
            with self._cond:
                latest = self._latest
            version = NOTHING_NEWER
            if latest is not None and latest[0] > have:
                version = latest[0] if latest[1].signature == signature else MISMATCH
            hdr.fill_(version)
            group.broadcast(hdr, src=0)
            if version >= 0 and latest is not None:
                for flat in latest[1].buckets:
                    group.broadcast(flat, src=0)
                self.sent[worker] = self.sent.get(worker, 0) + 1


def link_device(mode: str, model_device: str) -> str:
    """The device of a link's buffers for ``weights.fast_path`` = ``mode``: the model's (``auto``: NCCL for a GPU
    model), or the host (``gloo``: GPU weights go through host memory)."""
    return "cpu" if mode == "gloo" else model_device


def uses_push(device: str) -> bool:
    """Whether links on ``device`` push new versions (gloo) or answer requests (NCCL)."""
    return not str(device).startswith("cuda")


class FastPathClient:
    """Rollout-worker side: pull newer weights into a model over the link, or report that the files must be used."""

    def __init__(self, run_dir: RunDir, worker: int, *, device: str = "cpu", join_timeout_s: float = 10.0,
                 timeout_s: float = 600.0, retry_s: float = 60.0, bucket_bytes: int = 256 << 20):
        self.run_dir = run_dir
        self.bucket_bytes = bucket_bytes
        self._recv: PackedWeights | None = None
        self._taken = -1  # gloo: the newest version received over the current link
        self._latest_known = False  # gloo: whether the link's LATEST_KEY exists yet
        self._target: Any = None  # what the receive buffers unpack into: its tensors and where they lived
        self._tensors: list[Any] = []
        self._ptrs: list[int] = []
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
        """Take weights newer than ``have_version`` if the trainer has any; copy them into ``target`` (module or
        state dict) in place.

        Returns the version received, ``have_version`` if there is nothing newer (over gloo: nothing has arrived
        yet; this does not wait), or None if the link is down or the trainer's weights do not match ``target``
        (load the snapshot from the run dir instead).
        """
        if not self._connect():
            return None
        g = self._group
        try:
            if self._recv is None or target is not self._target or self._moved():
                sd = target.state_dict() if hasattr(target, "state_dict") else target
                self._recv = PackedWeights(sd, bucket_bytes=self.bucket_bytes, device=g.device, pack=False)
                self._target = target
                self._tensors = list(target.parameters()) + list(target.buffers()) if hasattr(
                    target, "parameters") else list(target.values())
                self._ptrs = [t.data_ptr() for t in self._tensors]
            return (self._take if uses_push(str(g.device)) else self._request)(g, have_version)
        except RelaxError as exc:  # lasting: retry only after retry_s
            log.warning("fast path refused (%s); using weight snapshots", exc)
            self.close()
            self._next_try = time.monotonic() + self.retry_s
            return None
        except Exception as exc:
            log.info("fast path broke (%s); using weight snapshots", str(exc).splitlines()[0] if str(exc) else exc)
            self.close()
            self._next_try = time.monotonic() + 1.0
            return None

    def _moved(self) -> bool:
        """Whether a tensor of the target got new storage (``p.data = ...``) since the receive buffers were made.
        Loading in place (``copy_``, as the snapshot reader does) keeps them; so must anything else that changes
        the target's weights while it is pulled into."""
        return any(t.data_ptr() != p for t, p in zip(self._tensors, self._ptrs))

    def _take(self, g: Any, have_version: int, *, catch_up_s: float = 2.0) -> int:
        """gloo: receive the announced version if it is new to this link (its buckets are already on the way). If
        the trainer already has a newer one (a worker that pulls seldom finds an old version waiting in the link),
        receive until the newest arrived (at most ``catch_up_s``)."""
        newest = self._take_announced(g, have_version)
        if self._taken < 0:
            return newest
        deadline = time.monotonic() + catch_up_s
        while time.monotonic() < deadline:
            latest = g.get_key(LATEST_KEY, known=self._latest_known)
            self._latest_known = latest is not None  # once set, the key stays: skip the existence check
            if latest is None or int(latest) <= self._taken:
                break
            got = self._take_announced(g, newest)
            if got == newest:
                time.sleep(0.0005)  # the serving thread announces the newest once the old one is taken
            newest = got
        return newest

    def _take_announced(self, g: Any, have_version: int) -> int:
        assert self._recv is not None
        note = g.get_key(ANNOUNCE_KEY, known=self._taken >= 0)
        if note is None:
            return have_version
        version, signature = (int(x) for x in note.split())
        if version <= self._taken:
            return have_version  # nothing newer announced
        if signature != self._recv.signature:
            raise RelaxError("the trainer's weights differ from this worker's model in names, dtypes or shapes")
        for work in [g.broadcast_async(flat, src=0) for flat in self._recv.buckets]:
            work.wait()
        self._taken = version
        if version <= have_version:
            return have_version  # the files were newer (a late link): keep what the model holds
        self._recv.unpack()
        return version

    def _request(self, g: Any, have_version: int) -> int:
        """NCCL: ask for a version newer than ``have_version`` and receive it."""
        import torch

        assert self._recv is not None
        g.broadcast(torch.tensor([have_version, self._recv.signature], dtype=torch.int64, device=g.device), src=1)
        hdr = torch.zeros(1, dtype=torch.int64, device=g.device)
        g.broadcast(hdr, src=0)
        version = int(hdr.item())
        if version == MISMATCH:
            raise RelaxError("the trainer's weights differ from this worker's model in names, dtypes or shapes")
        if version == NOTHING_NEWER:
            return have_version
        for flat in self._recv.buckets:
            g.broadcast(flat, src=0)
        self._recv.unpack()
        return version

    def close(self) -> None:
        self._taken = -1
        self._latest_known = False
        if self._group is not None:
            self._group.close()
            self._group = None
