"""Delta snapshots: a version stored as the difference from a full base version, tensor by tensor.

A delta snapshot is a complete snapshot folder ``weights/vNNNNNN`` like any other (``COMPLETE`` last, then LATEST),
whose manifest has ``"delta": {"base": B, "full_bytes": N}`` and one file, ``delta.bin``: per tensor, the payload of
one codec at the ``offset``/``bytes`` its piece names. Codecs:

* ``xor-zstd``: the tensor's bytes XOR the base tensor's bytes, zstd-compressed (an unchanged bf16 element is two
  zero bytes; a changed one mostly differs in the low mantissa bits, which zstd packs well);
* ``sparse``: little-endian uint32 indices of the changed elements, then their new values (raw);
* ``raw``: the tensor's bytes zstd-compressed (a tensor new in this version or whose dtype/shape changed).

Every piece carries the checksum of the *reconstructed* tensor bytes (``xxh3_128``, at about ten times sha256's
speed; a piece written before that field carries their ``sha256``, which the reader then checks), and ``delta.bin``
its file sha256 in ``files``, so a damaged delta, a damaged base and a base that is not the one the delta was made
from are all detected (:class:`SnapshotError`); :class:`~relax_hpc.weights.reader.SnapshotReader` then falls back to
an older intact version. The base is always a full version (never a chain of deltas): reconstruction reads the base
and one delta. The publisher writes a full version every ``every_full`` versions and whenever a delta would exceed
``max_fraction`` of the full size; retention keeps every base a kept (or leased) delta needs.

A delta folder is not itself an HF model folder: :func:`relax_hpc.weights.materialise.materialise` writes
the reconstructed version as one (the on-read materialisation for server engines' update-from-disk, and for a
user who wants a delta version as a model folder).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np

from relax_hpc.errors import SnapshotError

if TYPE_CHECKING:
    import torch

Codec = Literal["xor-zstd", "sparse"]
DELTA_FILE = "delta.bin"
PARALLEL_BYTES = 4 << 20
"""Delta versions of models larger than this are decoded on several threads."""
_LEVEL = 1
"""zstd level: 1 packs XOR deltas within a few per cent of level 3 at twice the speed (see bench weights --delta)."""


class DeltaPolicy(NamedTuple):
    """When the publisher writes a delta: at most ``every_full - 1`` deltas after each full version, each no larger
    than ``max_fraction`` of the full size, encoded with ``codec``."""

    every_full: int = 20
    max_fraction: float = 0.5
    codec: Codec = "xor-zstd"


def delta_policy(cfg: Any) -> DeltaPolicy | None:
    """The publisher's policy from ``weights.delta`` (a :class:`~relax_hpc.config.weights.DeltaConfig`, or None)."""
    if cfg is None:
        return None
    return DeltaPolicy(every_full=cfg.every_full, max_fraction=cfg.max_fraction, codec=cfg.codec)


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError as exc:  # a dependency of the package; a clear line if an install lacks it
        raise SnapshotError("delta snapshots need the 'zstandard' package (pip install zstandard)") from exc
    return zstandard


def _xxh3() -> Any:
    import xxhash

    return xxhash


def tensor_checksum(data: Any) -> str:
    """The ``xxh3_128`` hex digest of a tensor's bytes, as a delta piece records it."""
    return str(_xxh3().xxh3_128_hexdigest(data))


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's raw bytes as a uint8 numpy array (a view where the tensor is contiguous on the CPU)."""
    import torch

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _elements(raw: np.ndarray, itemsize: int) -> np.ndarray:
    return raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])


def encode_tensor(new: np.ndarray, base: np.ndarray | None, itemsize: int, codec: Codec) -> tuple[str, bytes]:
    """One tensor's payload: (codec used, bytes). ``new``/``base``: uint8 byte arrays (base None: no usable base)."""
    z = _zstd()
    if base is None or base.shape != new.shape:
        return "raw", z.ZstdCompressor(level=_LEVEL).compress(new.tobytes())
    if codec == "sparse":
        a, b = _elements(new, itemsize), _elements(base, itemsize)
        idx = np.flatnonzero(a != b).astype("<u4")
        return "sparse", idx.tobytes() + a[idx].tobytes()
    return "xor-zstd", z.ZstdCompressor(level=_LEVEL).compress(np.bitwise_xor(new, base).tobytes())


def decode_tensor(codec: str, payload: bytes | memoryview, base: np.ndarray | None, nbytes: int,
                  itemsize: int, *, in_place: bool = False, scratch: np.ndarray | None = None) -> np.ndarray:
    """The reconstructed bytes of one tensor (uint8 array of ``nbytes``); SnapshotError if the payload is bad.
    ``in_place``: ``base`` is the caller's own (writable) and becomes the result, no new buffer is allocated.
    ``scratch``: a uint8 buffer of at least ``nbytes`` that an XOR payload is decompressed into (reused across
    tensors, it spares a fresh allocation's page faults: about 1.6x faster decompression)."""
    z = _zstd()
    try:
        if codec == "raw":
            out = np.frombuffer(z.ZstdDecompressor().decompress(payload, max_output_size=nbytes), np.uint8)
        elif base is None or base.size != nbytes:
            raise SnapshotError(f"codec {codec!r} needs a base tensor of {nbytes} bytes")
        elif codec == "xor-zstd":
            x = _decompress(z, payload, nbytes, scratch)
            out = np.bitwise_xor(x, base, out=base) if in_place else np.bitwise_xor(x, base)
        elif codec == "sparse":
            count, rest = divmod(len(payload), 4 + itemsize)
            if rest:
                raise SnapshotError(f"sparse payload of {len(payload)} bytes is not whole index/value pairs")
            idx = np.frombuffer(payload, "<u4", count)
            vals = np.frombuffer(payload, _elements(base[:0], itemsize).dtype, count, offset=4 * count)
            out = base if in_place else base.copy()
            el = _elements(out, itemsize)
            if count and int(idx.max()) >= el.size:
                raise SnapshotError("sparse index out of range")
            el[idx] = vals
        else:
            raise SnapshotError(f"unknown delta codec {codec!r}")
    except z.ZstdError as exc:
        raise SnapshotError(f"corrupt {codec} payload: {exc}") from exc
    if out.size != nbytes:
        raise SnapshotError(f"reconstructed {out.size} bytes, expected {nbytes}")
    return out


def _decompress(z: Any, payload: bytes | memoryview, nbytes: int, scratch: np.ndarray | None) -> np.ndarray:
    """A zstd frame of exactly ``nbytes`` decompressed bytes, into ``scratch`` where given; SnapshotError else."""
    if scratch is None or scratch.size < nbytes:
        x = np.frombuffer(z.ZstdDecompressor().decompress(payload, max_output_size=nbytes), np.uint8)
        got = x.size
    else:
        x, got = scratch[:nbytes], 0
        view = memoryview(x.data).cast("B")
        with z.ZstdDecompressor().stream_reader(payload) as r:
            while got < nbytes and (n := r.readinto(view[got:])):
                got += n
            got += len(r.read(1))  # a byte past nbytes: the frame is longer than the tensor
    if got != nbytes:
        raise SnapshotError(f"decompressed {'more than ' if got > nbytes else ''}{min(got, nbytes)} bytes, "
                            f"expected {nbytes}")
    return x


def encode_delta(state: Mapping[str, torch.Tensor], base: Mapping[str, np.ndarray],
                 codec: Codec) -> tuple[list[bytes], dict[str, dict[str, Any]]]:
    """Encode ``state`` against ``base`` (name -> uint8 bytes of the base version): (payloads in order, pieces by
    tensor name with ``codec``, ``offset``, ``bytes`` and the ``xxh3_128`` of the tensor's own bytes)."""
    payloads: list[bytes] = []
    pieces: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, t in state.items():
        raw = _bytes(t)
        used, data = encode_tensor(raw, base.get(name), t.element_size(), codec)
        pieces[name] = {"file": DELTA_FILE, "key": name, "codec": used, "offset": offset, "bytes": len(data),
                        "xxh3_128": tensor_checksum(raw.data)}
        payloads.append(data)
        offset += len(data)
    return payloads, pieces


def base_bytes(state: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A private copy of a version's tensor bytes, kept by the publisher as the base of the next deltas."""
    return {name: _bytes(t).copy() for name, t in state.items()}


def base_of(manifest: Mapping[str, Any]) -> int | None:
    """The base version a manifest's snapshot is a delta of (None: a full snapshot)."""
    d = manifest.get("delta")
    return int(d["base"]) if isinstance(d, Mapping) and isinstance(d.get("base"), int) else None


def apply_delta(folder: Path, manifest: dict[str, Any], base_state: Mapping[str, torch.Tensor], *,
                verify: str) -> dict[str, torch.Tensor]:
    """Reconstruct a delta snapshot's state dict (CPU) from its base version's state and ``folder/delta.bin``;
    every tensor is checked against the checksum of its reconstructed bytes (``xxh3_128``; ``sha256`` for a piece
    written without it).

    ``base_state`` is consumed: its tensors are this call's own (the reader loads the base for it), so each is
    reconstructed in place, with no second model-sized buffer. ``delta.bin`` is hashed as a whole (``verify:
    sha256``) only when a tensor fails, to say whether the delta or the base is damaged: the tensors' own checksums
    already cover every byte that is used."""
    entry = manifest["files"][0]
    data = (folder / entry["name"]).read_bytes()
    if len(data) != entry["bytes"]:
        raise SnapshotError(f"{folder / entry['name']}: {len(data)} bytes, the manifest says {entry['bytes']}: "
                            "corrupt delta")
    try:
        return _decode_all(folder, manifest, base_state, memoryview(data))
    except SnapshotError as exc:
        if verify == "sha256" and hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise SnapshotError(f"{folder / entry['name']}: sha256 does not match the manifest: corrupt delta") from exc
        raise


def decode_threads() -> int:
    """Threads that reconstruct a large delta: every core this process may use (at most 8); zstd and numpy's XOR
    release the GIL, and reconstruction has no I/O of its own to leave a core for."""
    from relax_hpc.weights.format import usable_cores

    return max(1, min(8, usable_cores()))


def _decode_all(folder: Path, manifest: dict[str, Any], base_state: Mapping[str, torch.Tensor],
                view: memoryview) -> dict[str, torch.Tensor]:
    import torch

    from relax_hpc.weights.format import torch_dtype

    ptrs = Counter(b.data_ptr() for b in base_state.values() if b.numel())
    shared = {ptr for ptr, n in ptrs.items() if n > 1}  # one buffer behind two names (tied): copied, not reused

    scratch: dict[int, np.ndarray] = {}  # one decompression buffer per thread, freed with this call

    def buffer(nbytes: int) -> np.ndarray:
        key = threading.get_ident()
        if key not in scratch or scratch[key].size < nbytes:
            scratch[key] = np.empty(nbytes, np.uint8)
        return scratch[key]

    def one(name: str, t: dict[str, Any]) -> torch.Tensor:
        p = t["pieces"][0]
        dtype, shape = torch_dtype(t["dtype"]), [int(d) for d in t["shape"]]
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = itemsize * int(np.prod(shape, dtype=np.int64))
        b = base_state.get(name)
        base_raw = _bytes(b) if b is not None else None
        in_place = (b is not None and b.numel() > 0 and b.device.type == "cpu" and b.is_contiguous()
                    and b.data_ptr() not in shared and base_raw is not None and base_raw.flags.writeable)
        try:
            out = decode_tensor(p["codec"], view[p["offset"]:p["offset"] + p["bytes"]], base_raw, nbytes, itemsize,
                                in_place=in_place,
                                scratch=buffer(nbytes) if in_place and p["codec"] == "xor-zstd" else None)
        except (SnapshotError, KeyError, TypeError, ValueError) as exc:
            raise SnapshotError(f"{folder / DELTA_FILE}: tensor {name!r}: {exc}") from exc
        if not _matches(out, p):
            raise SnapshotError(f"{folder}: tensor {name!r} reconstructed from base v{base_of(manifest):06d} does not "
                                "match its checksum: corrupt delta or base")
        return torch.from_numpy(out).view(dtype).reshape(shape)

    items = list(manifest["tensors"].items())
    threads = decode_threads() if int(manifest["delta"].get("full_bytes", 0)) > PARALLEL_BYTES else 1
    if threads == 1:
        return {name: one(name, t) for name, t in items}
    with ThreadPoolExecutor(threads, thread_name_prefix="delta") as pool:
        futures = [(name, pool.submit(one, name, t)) for name, t in items]
        return {name: f.result() for name, f in futures}


def _matches(out: np.ndarray, piece: Mapping[str, Any]) -> bool:
    """Whether reconstructed bytes match their piece: ``xxh3_128`` where the piece has it, else ``sha256``."""
    if "xxh3_128" in piece:
        return tensor_checksum(out.data) == piece["xxh3_128"]
    return hashlib.sha256(out.data).hexdigest() == piece.get("sha256")


def dir_bytes(folder: Path) -> int:
    """Bytes of the files directly in ``folder`` (for benchmarks and reports)."""
    return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())
