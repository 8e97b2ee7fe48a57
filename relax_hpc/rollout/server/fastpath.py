"""The rollout worker's end of the server fast path (:mod:`relax_hpc.weights.server_links`): ask trainer rank 0 for
weights newer than the server holds; the answer becomes a :class:`~relax_hpc.rollout.server.base.DistributedSource`
(the group's address and the buckets' names, dtypes and shapes) that the server engine hands to its server
(SGLang: ``/init_weights_update_group`` once per group, then ``/update_weights_from_distributed`` per bucket while
the trainer broadcasts; vLLM: ``/init_weight_transfer_engine`` once per group, then ``/update_weights`` per bucket).
Any failure of the transfer falls back to the snapshot files inside the engine (event ``weight_sync_fallback``).

The group's world size is the trainer's rank plus the ranks of the worker's server. A server engine that knows its
server's ranks (vLLM: DP x TP x PP from ``/server_info``) tells the trainer on the link's control store
(``world_size``) before its first request; otherwise the link's announced world size stands."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from relax_hpc.fsio import read_json
from relax_hpc.rollout.server.base import DistributedSource, GroupInfo
from relax_hpc.rundir import RunDir
from relax_hpc.weights.server_links import NOTHING, link_file

log = logging.getLogger(__name__)


class ServerFastPath(DistributedSource):
    """Fetch a version over the link of rollout worker ``worker``; then this is the source for ``engine.receive``."""

    def __init__(self, run_dir: RunDir, worker: int, *, timeout_s: float = 10.0,
                 server_ranks: Callable[[], int | None] | None = None):
        super().__init__(GroupInfo("", 0, 1), [])
        self.run_dir, self.worker, self.timeout_s = run_dir, worker, timeout_s
        self.server_ranks = server_ranks
        """The ranks the worker's server brings into the group (None: not known; the announced size stands)."""
        self._info: dict[str, Any] | None = None
        self._control: Any = None
        self.device = "cpu"

    def _connect(self) -> bool:
        import torch.distributed as dist

        info = read_json(link_file(self.run_dir, self.worker), default=None)
        if not isinstance(info, dict):
            return False
        if self._info is not None and info.get("generation") == self._info.get("generation") and self._control:
            return True
        try:
            self._control = dist.TCPStore(info["host"], int(info["control_port"]), None, False,
                                          timeout=timedelta(seconds=self.timeout_s))
        except (RuntimeError, dist.DistError, KeyError, ValueError) as exc:
            log.info("server fast path not available (%s); using weight snapshots", str(exc).splitlines()[0])
            self._control = None
            return False
        ranks = self.server_ranks() if self.server_ranks is not None else None
        world = int(info["world_size"]) if ranks is None else 1 + ranks
        try:
            if ranks is not None:
                self._control.set("world_size", str(world))  # read by the trainer when it forms the group
        except (RuntimeError, dist.DistError) as exc:
            log.info("server fast path not available (%s); using weight snapshots", str(exc).splitlines()[0])
            self._control = None
            return False
        self._info = info
        packed = info.get("packed") or {}
        self.group = GroupInfo(info["host"], int(info["port"]), world, rank_offset=1,
                               group_name=str(info["group_name"]), backend=str(info["backend"]),
                               packed=bool(packed.get("packed", True)),
                               packed_buffer_size_bytes=int(packed.get("buffer_size_bytes", 1 << 30)),
                               packed_num_buffers=int(packed.get("num_buffers", 2)))
        self.metas = [[(str(n), str(d), list(s)) for n, d, s in b] for b in info["buckets"]]
        return True

    def fetch(self, have_version: int) -> int | None:
        """The version the trainer will broadcast next (> ``have_version``), ``have_version`` when it has nothing
        newer, or None when there is no link (use the files)."""
        import torch.distributed as dist

        if not self._connect():
            return None
        try:
            n = self._control.add("seq", 1) - 1
            self._control.set(f"want/{n}", str(have_version))
            self._control.wait([f"send/{n}"], timedelta(seconds=self.timeout_s))
            version = int(self._control.get(f"send/{n}").decode())
        except (RuntimeError, dist.DistError, ValueError) as exc:
            log.info("server fast path broke (%s); using weight snapshots", str(exc).splitlines()[0])
            self.close()
            return None
        return have_version if version == NOTHING else version

    def close(self) -> None:
        self._control = None
        self._info = None
