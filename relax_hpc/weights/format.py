"""safetensors files written and read at disk speed, with sha256 computed on the bytes as they pass.

The files are standard safetensors (8-byte little-endian header length, JSON header padded with spaces to a multiple
of 8, then the tensors' bytes back to back with no holes), readable by the ``safetensors`` library. Tensors are laid
out by decreasing element size, so every tensor starts at an offset aligned to its element size and a reader can
expose it as a view of one file-sized buffer without copying.

Hashing never costs a second pass: the writer hands each tensor's bytes both to ``write`` and to background threads
that update the sha256 (``hashlib`` and file I/O both release the GIL), and the reader hashes each chunk while it
reads the next one into a preallocated buffer. Files are hashed in parallel, one stream per file, so verification
keeps up with fast storage when a snapshot has several files. torch is imported lazily.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from relax_hpc.errors import SnapshotError

if TYPE_CHECKING:
    import torch

CHUNK_BYTES = 16 << 20
"""Read granularity: large enough for full-speed sequential reads, small enough to overlap hashing with reading."""
PARALLEL_READ_BYTES = 64 << 20
"""Files at least this large are read on several threads where nothing hashes them as they are read."""

_DTYPE_NAMES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
}


def st_dtype(tensor: torch.Tensor) -> str:
    """The safetensors name of a tensor's dtype (``BF16``); :class:`SnapshotError` for unsupported dtypes."""
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise SnapshotError(f"tensor dtype {tensor.dtype} cannot be stored in a weight snapshot")
    return _DTYPE_NAMES[name]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name; :class:`SnapshotError` if unknown."""
    import torch

    for tname, sname in _DTYPE_NAMES.items():
        dtype = vars(torch).get(tname) if sname == name else None  # float8 types exist in newer torch only
        if isinstance(dtype, torch.dtype):
            return dtype
    raise SnapshotError(f"unknown tensor dtype {name!r}")


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a tensor as a memoryview (no copy for contiguous CPU tensors)."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def usable_cores() -> int:
    """The cores this process may use (its CPU affinity where the platform tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 2


def hash_threads() -> int:
    """Hash worker threads: the cores this process may use, less one for I/O, at most 4."""
    return max(1, min(4, usable_cores() - 1))


class HashPipeline:
    """sha256 digests of several byte streams (one per file), computed on background threads while the caller does I/O.

    Each stream is hashed in order by one worker; different streams run on different workers in parallel. ``feed``
    never blocks; the buffers fed must stay unchanged until :meth:`finish` returns. Use as a context manager so the
    threads end on errors too. ``threads=0`` hashes on the caller's thread as it feeds (for small snapshots, where
    starting the threads costs more than the hashing).
    """

    def __init__(self, threads: int | None = None) -> None:
        self._hashes: list[Any] = []
        n = hash_threads() if threads is None else threads  # 0: hashed on the caller's thread
        self._queues: list[queue.SimpleQueue[tuple[int, memoryview] | None]] = [queue.SimpleQueue() for _ in range(n)]
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"sha256-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()
        self._done = False

    def _run(self, q: queue.SimpleQueue[tuple[int, memoryview] | None]) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            idx, data = item
            self._hashes[idx].update(data)

    def stream(self) -> int:
        """Start a new digest; returns its index for :meth:`feed`."""
        self._hashes.append(hashlib.sha256())
        return len(self._hashes) - 1

    def feed(self, idx: int, data: memoryview | bytes) -> None:
        if not self._queues:  # no workers (small snapshots: starting a thread costs more than hashing)
            self._hashes[idx].update(data)
            return
        self._queues[idx % len(self._queues)].put((idx, memoryview(data)))

    def finish(self) -> list[str]:
        """Wait for the threads and return every stream's hex digest, in stream order."""
        if not self._done:
            self._done = True
            for q in self._queues:
                q.put(None)
            for t in self._threads:
                t.join()
        return [h.hexdigest() for h in self._hashes]

    def __enter__(self) -> HashPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()


def write_file(path: Path, items: list[tuple[str, torch.Tensor]], hasher: HashPipeline,
               metadata: dict[str, str] | None = None) -> tuple[int, int]:
    """Write ``items`` (key, tensor) as one safetensors file. Returns (bytes written, hash stream index).

    OSError propagates (the caller names the file); the file is not fsynced here.
    """
    order = sorted(range(len(items)), key=lambda i: -items[i][1].element_size())
    header: dict[str, Any] = {}
    offset = 0
    for i in order:
        key, t = items[i]
        n = tensor_nbytes(t)
        header[key] = {"dtype": st_dtype(t), "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if metadata:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    prefix = struct.pack("<Q", len(raw)) + raw
    stream = hasher.stream()
    with open(path, "wb", buffering=4 << 20) as f:
        f.write(prefix)
        hasher.feed(stream, prefix)
        for i in order:
            data = tensor_bytes(items[i][1])
            f.write(data)
            hasher.feed(stream, data)
    return len(prefix) + offset, stream


def read_file(path: Path, size: int, hasher: HashPipeline | None, *, pin_memory: bool = False) -> tuple[Any, int]:
    """Read a whole file into one uint8 tensor, feeding each chunk to ``hasher`` as soon as it is read.

    Returns (buffer, hash stream index or -1). :class:`SnapshotError` if the size differs from ``size``.
    """
    import torch

    try:
        actual = os.stat(path).st_size
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise SnapshotError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if actual != size:
        raise SnapshotError(f"{path} has {actual} bytes, the manifest says {size}: truncated or corrupt snapshot")
    if pin_memory:
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    else:  # numpy asks for transparent huge pages on large arrays: page faults cost ~4x less than torch.empty's
        buf = torch.from_numpy(np.empty(size, dtype=np.uint8))
    view = memoryview(buf.numpy()).cast("B") if size else memoryview(b"")
    if hasher is None and size >= PARALLEL_READ_BYTES and usable_cores() > 1:
        _read_parallel(path, view, size)
        return buf, -1
    stream = hasher.stream() if hasher is not None else -1
    with open(path, "rb", buffering=0) as f:
        off = 0
        while off < size:
            n = f.readinto(view[off:off + CHUNK_BYTES])
            if not n:
                raise SnapshotError(f"{path} ended after {off} of {size} bytes while reading")
            if hasher is not None:
                hasher.feed(stream, view[off:off + n])
            off += n
    return buf, stream


def _read_parallel(path: Path, view: memoryview, size: int) -> None:
    """Read ``path`` into ``view`` as one contiguous range per core, each thread with its own ``preadv``: the page
    faults of the fresh buffer and the copies out of the page cache (or the network client) run on every core."""
    from concurrent.futures import ThreadPoolExecutor

    n = min(8, usable_cores(), max(1, size // CHUNK_BYTES))
    bounds = [size * i // n for i in range(n + 1)]
    fd = os.open(path, os.O_RDONLY)
    try:
        def part(lo: int, hi: int) -> None:
            off = lo
            while off < hi:
                got = os.preadv(fd, [view[off:min(hi, off + CHUNK_BYTES)]], off)
                if not got:
                    raise SnapshotError(f"{path} ended after {off} of {size} bytes while reading")
                off += got

        with ThreadPoolExecutor(n, thread_name_prefix="read") as pool:
            for f in [pool.submit(part, bounds[i], bounds[i + 1]) for i in range(n)]:
                f.result()
    finally:
        os.close(fd)


def parse_file(path: Path, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file held in ``buf``, as views of it where aligned (copies otherwise)."""
    size = buf.numel()
    if size < 8:
        raise SnapshotError(f"{path} is not a safetensors file (only {size} bytes)")
    (hlen,) = struct.unpack("<Q", buf[:8].numpy().tobytes())
    if 8 + hlen > size:
        raise SnapshotError(f"{path} is not a safetensors file (header length {hlen} beyond end of file)")
    try:
        header = json.loads(buf[8:8 + hlen].numpy().tobytes())
    except ValueError as exc:
        raise SnapshotError(f"{path} has a corrupt safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise SnapshotError(f"{path} has a corrupt safetensors header (not an object)")
    base = 8 + hlen
    out: dict[str, torch.Tensor] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = torch_dtype(info["dtype"])
            shape = [int(d) for d in info["shape"]]
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SnapshotError(f"{path}: bad header entry for tensor {key!r}: {exc}") from exc
        numel = 1
        for d in shape:
            numel *= d
        elem = dtype.itemsize
        if not (0 <= start <= end <= size - base) or end - start != numel * elem:
            raise SnapshotError(f"{path}: tensor {key!r} has offsets {start}..{end} that do not match its "
                                f"shape {shape} or the file size")
        raw = buf[base + start:base + end]
        if (base + start) % elem:
            raw = raw.clone()
        out[key] = raw.view(dtype).view(shape)
    return out
