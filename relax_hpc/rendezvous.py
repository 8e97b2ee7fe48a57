"""Rendezvous through the run dir: trainer rank 0 and rollout workers form a torch.distributed group for the fast path.

Rank 0 opens a ``torch.distributed.TCPStore`` on a free port and publishes ``RUN_DIR/rendezvous/<group>.json`` =
``{"group", "host", "port", "world_size", "generation", "nonce", "backend", "time", "pid"}`` atomically. Every other
rank waits for that file (with a timeout, logging what it waits for), probes the address, connects, checks the
store's nonce against the file's, and joins. A rank 0 that restarts publishes ``generation + 1`` with a new nonce; a
file whose address does not answer or whose nonce differs from the store's is stale and is waited past.

:func:`rendezvous_store` returns that store (private to the generation) for ``init_process_group(store=...)``,
which is how trainer ranks form their default group. :func:`form_group` builds a group directly on the store
(``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA), so it is independent of any default process group the
process has (the trainer's own FSDP group) and never touches it; its collectives are called on
:class:`FastPathGroup`, not through ``torch.distributed.<collective>(group=...)``. A group has a fixed membership:
if a member dies, every member closes it and rank 0 publishes a new generation.

:func:`broadcast_state_dict` sends a state dict from one rank into the other ranks' existing tensors, in buckets of
one dtype each, checking first that every rank holds the same names, dtypes and shapes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from relax_hpc.errors import RelaxError, WaitTimeout
from relax_hpc.fsio import atomic_write_json, read_json, refresh_nfs_cache, wait_for
from relax_hpc.rundir import RunDir

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_GROUP_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class RendezvousInfo:
    """The content of ``rendezvous/<group>.json``."""

    group: str
    host: str
    port: int
    world_size: int
    generation: int
    nonce: str
    backend: str
    time: float
    pid: int

    @classmethod
    def read(cls, path: Path) -> RendezvousInfo | None:
        """The record in ``path``, or None if it is missing or not a valid record."""
        try:
            rec = read_json(path)
            return cls(**{k: rec[k] for k in cls.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError):
            return None


class FastPathGroup:
    """A process group of its own (not the default group): collectives on ``device``, with a timeout."""

    def __init__(self, backend: Any, store: Any, rank: int, info: RendezvousInfo, device: torch.device):
        self._pg = backend
        self._store = store
        self.rank = rank
        self.world_size = info.world_size
        self.info = info
        self.device = device

    @property
    def generation(self) -> int:
        return self.info.generation

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` in place from rank ``src``."""
        self.broadcast_async(tensor, src).wait()

    def broadcast_async(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Start a broadcast of ``tensor`` from rank ``src``; returns its work (``is_completed()``, ``wait()``)."""
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return self._pg.broadcast([tensor], opts)

    def set_key(self, key: str, value: str) -> None:
        """Set ``key`` in the group's store (served by rank 0's process on a C++ thread: no Python there)."""
        self._store.set(key, value)

    def get_key(self, key: str, *, known: bool = False) -> str | None:
        """The value of ``key`` in the group's store, or None if it is not set (does not wait; ``known``: it is
        set, skip the check)."""
        if not known and not self._store.check([key]):
            return None
        return self._store.get(key).decode()

    def all_reduce(self, tensor: torch.Tensor, op: Literal["sum", "min", "max"] = "sum") -> None:
        """All-reduce ``tensor`` in place."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        opts.reduceOp = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        self._pg.allreduce([tensor], opts).wait()

    def barrier(self) -> None:
        """Wait until every member reaches this point."""
        import torch

        self.all_reduce(torch.zeros(1, device=self.device))

    def close(self) -> None:
        """Release the group's communicators and the store connection."""
        pg, self._pg = self._pg, None
        if pg is not None:
            shutdown = getattr(pg, "shutdown", None)
            if shutdown is not None:
                try:
                    shutdown()
                except RuntimeError as exc:
                    log.debug("fast-path group shutdown: %s", exc)
        self._store = None

    def __enter__(self) -> FastPathGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _advertised_host(host: str | None) -> str:
    return host or os.environ.get("RELAX_HPC_RDZV_HOST") or socket.gethostname()


def _answers(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _make_backend(store: Any, rank: int, world_size: int, device: torch.device, timeout: timedelta) -> Any:
    import torch.distributed as dist

    if device.type == "cuda":
        import torch

        if not hasattr(dist, "ProcessGroupNCCL"):
            raise RelaxError("this torch build has no NCCL; use a CPU device for a gloo group")
        torch.cuda.set_device(device)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return dist.ProcessGroupGloo(store, rank, world_size, timeout)


def rendezvous_store(run_dir: RunDir | Path | str, group: str, *, rank: int, world_size: int,
                     timeout_s: float = 600.0, host: str | None = None, min_generation: int = 0,
                     probe_timeout_s: float = 5.0, backend: str = "gloo") -> Any:
    """The store of one generation of ``group``: rank 0 opens and publishes it, the other ranks find and join it.

    Returns a ``torch.distributed.PrefixStore`` private to this generation, e.g. for
    ``torch.distributed.init_process_group(store=...)`` (how the trainer ranks form their default group).
    """
    return _rendezvous(run_dir, group, rank=rank, world_size=world_size, timeout_s=timeout_s, host=host,
                       min_generation=min_generation, probe_timeout_s=probe_timeout_s, backend=backend)[1]


def _rendezvous(run_dir: RunDir | Path | str, group: str, *, rank: int, world_size: int, timeout_s: float,
                host: str | None, min_generation: int, probe_timeout_s: float,
                backend: str) -> tuple[RendezvousInfo, Any, Path]:
    import torch.distributed as dist

    if not _GROUP_RE.match(group):
        raise ValueError(f"group name must be letters, digits, '_', '.', '-', got {group!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    path = rd.rendezvous_file(group)
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        store = dist.TCPStore(_advertised_host(host), 0, None, True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False)
        previous = RendezvousInfo.read(path)
        info = RendezvousInfo(group=group, host=_advertised_host(host), port=int(store.port), world_size=world_size,
                              generation=max(previous.generation if previous else 0, min_generation) + 1,
                              nonce=uuid.uuid4().hex, backend=backend, time=time.time(), pid=os.getpid())
        store.set("relax_hpc/nonce", info.nonce)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, asdict(info), indent=None)
        log.info("rendezvous %s: generation %d at %s:%d, waiting for %d more ranks", group, info.generation,
                 info.host, info.port, world_size - 1)
    else:
        info, store = _join(path, group, world_size, min_generation, deadline, probe_timeout_s)
    store.set_timeout(timedelta(seconds=max(1.0, deadline - time.monotonic())))
    return info, dist.PrefixStore(f"relax_hpc/{group}/{info.generation}/{info.nonce}/", store), path


def form_group(run_dir: RunDir | Path | str, group: str, *, rank: int, world_size: int,
               device: str | torch.device = "cpu", timeout_s: float = 600.0, host: str | None = None,
               min_generation: int = 0, probe_timeout_s: float = 5.0) -> FastPathGroup:
    """Form (rank 0) or join (other ranks) the fast-path group ``group`` of ``world_size`` processes.

    ``device`` picks the backend: gloo for CPU, NCCL for CUDA; rank 0's choice holds (a CUDA rank joining a gloo
    group gets a CPU group, a CPU rank cannot join an NCCL group: :class:`RelaxError`). Rank 0 advertises ``host``
    (default: the ``RELAX_HPC_RDZV_HOST`` variable, else the host name). Joiners ignore files older than
    ``min_generation``. Raises :class:`WaitTimeout` saying what was waited for when nobody publishes or not
    everyone joins in time.
    """
    import torch
    import torch.distributed as dist

    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    deadline = time.monotonic() + timeout_s
    info, store, path = _rendezvous(run_dir, group, rank=rank, world_size=world_size, timeout_s=timeout_s,
                                    host=host, min_generation=min_generation, probe_timeout_s=probe_timeout_s,
                                    backend="nccl" if dev.type == "cuda" else "gloo")
    if rank != 0 and info.backend != ("nccl" if dev.type == "cuda" else "gloo"):  # rank 0 picked the backend
        if info.backend != "gloo":
            raise RelaxError(f"rank 0 formed group {group!r} with {info.backend}, which needs a GPU on every rank")
        log.info("group %s: rank 0 uses gloo; this rank's tensors go through host memory", group)
        dev = torch.device("cpu")
    timeout = timedelta(seconds=timeout_s)
    try:
        backend = _make_backend(store, rank, world_size, dev, timeout)
    except (RuntimeError, dist.DistError) as exc:
        what = f"all {world_size} ranks of group {group!r} (generation {info.generation}) to join via {path}"
        if time.monotonic() >= deadline - 1.0 or "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
            raise WaitTimeout(f"timed out after {timeout_s:.0f}s waiting for {what}") from exc
        raise RelaxError(f"could not form group {group!r} via {path}: {str(exc).splitlines()[0]}") from exc
    store.set_timeout(timeout)
    return FastPathGroup(backend, store, rank, info, dev)


def _join(path: Path, group: str, world_size: int, min_generation: int, deadline: float,
          probe_timeout_s: float) -> tuple[RendezvousInfo, Any]:
    import torch.distributed as dist

    stale: set[str] = set()
    last: list[str] = ["no file yet"]

    def usable() -> RendezvousInfo | None:
        refresh_nfs_cache(path)
        info = RendezvousInfo.read(path)
        if info is None:
            return None
        if info.nonce in stale:
            return None
        if info.generation < min_generation:
            last[0] = f"generation {info.generation} is older than {min_generation}"
            return None
        if info.world_size != world_size:
            last[0] = f"generation {info.generation} has world_size {info.world_size}, this rank expects {world_size}"
            return None
        if not _answers(info.host, info.port, probe_timeout_s):  # probed again at the next poll
            last[0] = f"generation {info.generation} is stale (nobody answers at {info.host}:{info.port})"
            return None
        return info

    log.info("rendezvous %s: waiting for rank 0 to publish %s", group, path)
    while True:
        remaining = deadline - time.monotonic()
        try:
            info = wait_for(usable, what=f"rank 0 of group {group!r} to publish {path}",
                            timeout_s=max(0.0, remaining), logger=log)
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc} (last seen: {last[0]})") from exc
        try:
            store = dist.TCPStore(info.host, info.port, None, False,
                                  timeout=timedelta(seconds=max(1.0, min(probe_timeout_s, remaining))))
            if store.get("relax_hpc/nonce").decode() == info.nonce:
                log.info("rendezvous %s: joined generation %d at %s:%d", group, info.generation, info.host,
                         info.port)
                return info, store
        except (RuntimeError, dist.DistError) as exc:
            log.debug("rendezvous %s: store at %s:%d failed: %s", group, info.host, info.port, exc)
        stale.add(info.nonce)  # someone else listens there, or the store went away: wait for a new generation
        last[0] = f"generation {info.generation} is stale (its store does not answer as published)"


def state_signature(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int | None = None) -> int:
    """A 56-bit hash of the names, dtypes and shapes of ``state_dict`` (and of ``bucket_bytes`` if given)."""
    h = hashlib.sha256(b"" if bucket_bytes is None else f"buckets={bucket_bytes};".encode())
    for name in sorted(state_dict):
        t = state_dict[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)};".encode())
    return int.from_bytes(h.digest()[:7], "little")


def bucket_names(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """The names of ``state_dict`` in the order :func:`broadcast_state_dict` sends them, cut into buckets of one dtype
    and at most ``bucket_bytes`` (a tensor larger than that is a bucket of its own). Every rank computes the same
    buckets from state dicts with equal names, dtypes and shapes."""
    by_dtype: dict[str, list[str]] = {}
    for name in sorted(state_dict):
        by_dtype.setdefault(str(state_dict[name].dtype), []).append(name)
    out: list[list[str]] = []
    for dtype in sorted(by_dtype):
        bucket: list[str] = []
        size = 0
        for name in by_dtype[dtype]:
            t = state_dict[name]
            n = t.numel() * t.element_size()
            if bucket and size + n > bucket_bytes:
                out.append(bucket)
                bucket, size = [], 0
            bucket.append(name)
            size += n
        if bucket:
            out.append(bucket)
    return out


def broadcast_state_dict(group: FastPathGroup, state_dict: Mapping[str, torch.Tensor], src: int = 0, *,
                         bucket_bytes: int = 256 << 20) -> int:
    """Broadcast every tensor of ``state_dict`` from rank ``src`` into the same-named tensors of the other ranks.

    Tensors are sent in name order, grouped by dtype into flat byte buckets of at most ``bucket_bytes`` (a larger
    contiguous tensor is sent as is, without a copy); receivers copy each bucket into their existing tensors in
    place. All ranks first agree that names, dtypes and shapes match, else every rank raises :class:`RelaxError`.
    Returns the number of tensor bytes broadcast.
    """
    import torch

    sig = torch.tensor([state_signature(state_dict)], dtype=torch.int64, device=group.device)
    ref = sig.clone()
    group.broadcast(ref, src)
    ok = torch.tensor([int(bool(sig.item() == ref.item()))], dtype=torch.int64, device=group.device)
    group.all_reduce(ok, "min")
    if not ok.item():
        raise RelaxError(f"broadcast_state_dict: the ranks of group {group.info.group!r} hold state dicts with "
                         "different names, dtypes or shapes" + (" (this rank differs)" if sig.item() != ref.item()
                                                               else ""))
    total = 0
    for names in bucket_names(state_dict, bucket_bytes):
        bucket = [state_dict[n] for n in names]
        size = sum(t.numel() * t.element_size() for t in bucket)
        _send_bucket(group, bucket, size, src)
        total += size
    return total


def _send_bucket(group: FastPathGroup, bucket: list[torch.Tensor], nbytes: int, src: int) -> None:
    import torch

    if nbytes == 0:
        return
    if len(bucket) == 1 and bucket[0].is_contiguous():
        with torch.no_grad():
            group.broadcast(bucket[0].detach().view(-1).view(torch.uint8), src)
        return
    flat = torch.empty(nbytes, dtype=torch.uint8, device=bucket[0].device)
    with torch.no_grad():
        if group.rank == src:
            off = 0
            for t in bucket:
                n = t.numel() * t.element_size()
                flat[off:off + n].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
                off += n
        group.broadcast(flat, src)
        if group.rank != src:
            off = 0
            for t in bucket:
                n = t.numel() * t.element_size()
                t.copy_(flat[off:off + n].view(t.dtype).view(t.shape))
                off += n
