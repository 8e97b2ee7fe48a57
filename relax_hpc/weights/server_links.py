"""The fast path to inference servers (``rollout.server.weight_sync: distributed``): trainer rank 0 broadcasts new
weights straight into the servers of each rollout worker over a process group of their own, trainer rank 0 as rank 0
and the worker's server ranks after it (SGLang's ``/init_weights_update_group`` and
``/update_weights_from_distributed`` protocol; the engine side is :mod:`relax_hpc.rollout.server.fastpath`).

One link per rollout worker ``k``, announced in ``RUN_DIR/rendezvous/servers-<k>.json``
(:meth:`RunDir.rendezvous_file`): ``{host, port, control_port, world_size, group_name, generation, backend, buckets,
pid}``. ``port`` is where the group's rendezvous store will listen (a ``tcp://`` rendezvous: rank 0 hosts it);
``control_port`` a small store on which the worker asks for weights; ``buckets`` the names, dtypes and shapes of the
trainer's weights (HF names), bucket by bucket, as the server is told to receive them.

Per update the worker takes a number ``n`` (``add("seq", 1)``) and sets ``want/<n>`` = the version its server holds;
the link's thread answers ``send/<n>`` = the newest version it has (or -1: nothing newer), forms the group on first
use (:func:`init_group`, which blocks until the server joins through ``/init_weights_update_group``), then broadcasts
that version's tensors one by one in bucket order (the server posts one receive per tensor on each
``/update_weights_from_distributed`` call). Every wait is bounded by ``timeout_s``; a failure closes the group and
announces a new generation (a new port and group name), and the worker's engine loads the same version from the
snapshot files instead (an event says so). The trainer therefore still writes every version's snapshot
(:meth:`ServerLinks.all_linked` is False): the files stay the truth.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from relax_hpc.fsio import atomic_write_json
from relax_hpc.rundir import RunDir

if TYPE_CHECKING:
    from relax_hpc.weights.fastpath import PackedWeights

log = logging.getLogger(__name__)

NOTHING = -1


def link_file(run_dir: RunDir, worker: int) -> Any:
    return run_dir.rendezvous_file(f"servers-{worker}")


def init_group(backend: str, host: str, port: int, *, rank: int, world_size: int, group_name: str,
               timeout_s: float) -> Any:
    """A process group of its own (not the default group) formed by a ``tcp://host:port`` rendezvous, its store
    prefixed with ``group_name``, made by torch's group helper: the construction SGLang uses for its weight update
    group, so both ends build the same group."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefixed = c10d.PrefixStore(group_name, store)
    opts = "backend_options" if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters \
        else "pg_options"
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), prefixed,
                                           group_name=group_name,  # type: ignore[arg-type]
                                           timeout=timeout, **{opts: None})
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_group(pg: Any) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except Exception as exc:  # a group broken by a dead peer may not shut down cleanly
        log.debug("weights group destroy: %s", exc)


class ServerLinks:
    """Trainer rank 0: serve the newest weights to the servers of rollout workers ``0..num_workers-1``.

    The link (announcement, requests, answers) is this class's; the group and the broadcast are the hooks
    :meth:`form_group`, :meth:`broadcast_bucket` and :meth:`end_group` (torch c10d here, vLLM's own classes in
    :class:`~relax_hpc.weights.vllm_transfer.VLLMServerLinks`)."""

    group_prefix = "relax_weights"
    """The group's name is ``<group_prefix>_<worker>_<generation>``."""

    def __init__(self, run_dir: RunDir, num_workers: int, *, world_size: int, backend: str = "gloo",
                 timeout_s: float = 300.0, bucket_bytes: int = 256 << 20, device: str = "cpu"):
        self.run_dir, self.world_size, self.backend = run_dir, world_size, backend
        self.timeout_s, self.bucket_bytes, self.device = timeout_s, bucket_bytes, device
        self._latest: tuple[int, PackedWeights] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.sent: dict[int, int] = {}
        """worker -> versions broadcast to its servers (tests, metrics)."""
        self.failures: dict[int, int] = {}
        self._threads = [threading.Thread(target=self._serve, args=(k,), name=f"server-links-{k}", daemon=True)
                         for k in range(num_workers)]
        for t in self._threads:
            t.start()

    def all_linked(self) -> bool:
        return False  # the snapshot files of every version are written: a failed broadcast falls back to them

    def latest(self) -> tuple[int, PackedWeights] | None:
        """The newest version handed over and its packed copy (``None`` before the first)."""
        with self._lock:
            return self._latest

    def update(self, version: int, state_dict: Mapping[str, Any]) -> PackedWeights:
        """Hand over ``version`` (packed into a copy, so the trainer may go on); the copy's ``views()`` may be
        written to the snapshot files."""
        from relax_hpc.weights.fastpath import PackedWeights

        packed = PackedWeights(state_dict, bucket_bytes=self.bucket_bytes, device=self.device, pack=True)
        with self._lock:
            self._latest = (version, packed)
        return packed

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop serving. A broadcast under way is finished first (within ``timeout_s``): the process ending under
        it would cut the worker's server mid-version (it then loads the files)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _serve(self, worker: int) -> None:
        import torch.distributed as dist

        generation = 0
        while not self._stop.is_set():
            while self._latest is None and not self._stop.wait(0.05):
                pass
            if self._stop.is_set():
                return
            generation += 1
            control = dist.TCPStore(link_host(), 0, None, True, timeout=timedelta(seconds=self.timeout_s),
                                    wait_for_workers=False)
            info = self._announce(worker, generation, int(control.port))
            try:
                self._answer(worker, control, info)
            except Exception as exc:  # a timeout or a broken peer: a new generation, the worker uses the files
                self.failures[worker] = self.failures.get(worker, 0) + 1
                log.info("server fast path to rollout-%d closed: %s", worker, str(exc).splitlines()[0] if str(exc)
                         else type(exc).__name__)
            finally:
                del control

    def _announce(self, worker: int, generation: int, control_port: int) -> dict[str, Any]:
        from relax_hpc.rendezvous import bucket_names

        assert self._latest is not None
        sd = self._latest[1].views()
        buckets = [[[n, str(sd[n].dtype).removeprefix("torch."), list(sd[n].shape)] for n in names]
                   for names in bucket_names(sd, self.bucket_bytes)]
        info = {"host": link_host(), "port": link_port(), "control_port": control_port, "world_size": self.world_size,
                "group_name": f"{self.group_prefix}_{worker}_{generation}", "generation": generation,
                "backend": self.backend, **self.link_fields(), "buckets": buckets, "pid": os.getpid(),
                "time": time.time()}
        path = link_file(self.run_dir, worker)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, info, indent=None)
        return info

    def link_fields(self) -> dict[str, Any]:
        """Fields the announcement carries besides the common ones (none here)."""
        return {}

    def form_group(self, control: Any, info: dict[str, Any]) -> Any:
        """Form the group of the announced link (blocks until the worker's server joins)."""
        return init_group(self.backend, info["host"], info["port"], rank=0, world_size=self.world_size,
                          group_name=info["group_name"], timeout_s=self.timeout_s)

    def broadcast_bucket(self, group: Any, tensors: list[tuple[str, Any]]) -> None:
        """Broadcast one bucket's tensors (rank 0 the source), in order."""
        import torch.distributed as dist

        for _, t in tensors:
            dist.broadcast(t.contiguous(), src=0, group=group)

    def end_group(self, group: Any) -> None:
        destroy_group(group)

    def _answer(self, worker: int, control: Any, info: dict[str, Any]) -> None:
        """Answer the worker's requests on ``control`` until a failure or :meth:`close`."""
        import torch.distributed as dist

        group = None
        n = 0
        try:
            while not self._stop.is_set():
                key = f"want/{n}"  # the worker numbers its requests with control.add("seq", 1)
                try:
                    control.wait([key], timedelta(seconds=1.0))
                except (RuntimeError, dist.DistError):
                    continue  # nothing asked yet (waits for the worker as long as the run goes on)
                have = int(control.get(key).decode())
                with self._lock:
                    latest = self._latest
                version = latest[0] if latest is not None and latest[0] > have else NOTHING
                control.set(f"send/{n}", str(version))
                n += 1
                if version == NOTHING or latest is None:
                    continue
                if group is None:
                    group = self.form_group(control, info)
                views = latest[1].views()
                for bucket in info["buckets"]:
                    self.broadcast_bucket(group, [(name, views[name]) for name, _, _ in bucket])
                self.sent[worker] = self.sent.get(worker, 0) + 1
        finally:
            if group is not None:
                self.end_group(group)


def link_host() -> str:
    return os.environ.get("RELAX_HPC_RDZV_HOST") or socket.gethostname()


def link_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
