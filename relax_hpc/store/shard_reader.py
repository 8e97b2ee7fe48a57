"""Reading ``relax-hpc-shard/1`` files: verified header, then one read per dataset for a run of groups.

Opening never takes HDF5 file locks (Lustre without ``-o flock``, NFS). Anything that does not open or does not
verify raises :class:`CorruptShardError`; a group whose checksum fails is reported, never returned.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.errors import CorruptShardError
from relax_hpc.store import h5io, h5raw
from relax_hpc.store.sample import Sample
from relax_hpc.store.shard import BLOCKSUM, FORMAT, MAX_HEADER_BYTES, OFFSETS_OF, TURNS, blocksum

#: Datasets bigger than this (in this read) are read in pieces of this size, checksummed on a helper thread.
PIECE_BYTES = 8 << 20  # a multiple of DIGEST_BLOCK
_ITEM_BYTES = {"prompt_ids": 4, "response_ids": 4, "loss_mask": 1, "logprobs": 4, "reward": 8, "sample_json": 1,
               "turns": 4}


@dataclass
class ShardHeader:
    """The verified header and index of a shard (everything but the data)."""

    meta: dict[str, Any]
    sections: dict[str, np.ndarray]
    _bounds: dict[str, list[int]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_samples(self) -> int:
        return int(self.meta["num_samples"])

    @property
    def num_groups(self) -> int:
        return int(self.meta["num_groups"])

    @property
    def group_offsets(self) -> np.ndarray:
        return self.sections["group_offsets"]

    @property
    def versions(self) -> np.ndarray:
        return self.sections["version"]

    def group_crc(self) -> np.ndarray:
        return self.sections["group_crc"].reshape(self.num_groups, len(self.meta["datasets"]))

    def sample_offsets(self, dataset: str) -> np.ndarray:
        """Per-sample element offsets (N+1) of a per-sample data dataset."""
        if dataset == "reward":
            return np.arange(self.num_samples + 1, dtype=np.int64)
        if dataset.startswith("tensors/"):
            return self.sections[f"{dataset.removeprefix('tensors/')}.offsets"]
        if dataset == TURNS:
            return self.turn_offsets
        return self.sections[OFFSETS_OF[dataset]]

    @functools.cached_property
    def turn_offsets(self) -> np.ndarray:
        """Per-sample element offsets (N+1) of the ``turns`` column (two elements per turn)."""
        counts = self.sections["turn_counts"]
        out = np.zeros(counts.shape[0] + 1, np.int64)
        np.cumsum(2 * np.maximum(counts, 0), out=out[1:])
        return out

    def group_bounds(self, dataset: str) -> list[int]:
        """Element offsets (G+1) of a data dataset at group boundaries (computed once; do not modify)."""
        bounds = self._bounds.get(dataset)
        if bounds is None:
            if dataset == "sample_json":
                bounds = self.sections["json_group_offsets"].tolist()
            else:
                bounds = self.sample_offsets(dataset)[self.group_offsets].tolist()
            self._bounds[dataset] = bounds
        return bounds

    @functools.cached_property
    def sample_lists(self) -> tuple[list[int], ...]:
        """Group offsets, prompt and response offsets, per-group JSON offsets, version, version_first and
        version_last as lists (computed once)."""
        sec = self.sections
        names = ("group_offsets", "prompt_offsets", "response_offsets", "json_group_offsets")
        return tuple(sec[n].tolist() for n in (*names, "version", "version_first", "version_last"))

    def data_bytes(self) -> int | None:
        """Bytes of all data datasets, or None if the shard has big tensors (those are read in pieces)."""
        if self.meta.get("digests"):
            return None
        total = 0
        for name in self.meta["datasets"]:
            size = _ITEM_BYTES.get(name)
            if size is None:
                size = np.dtype(self.meta["tensors"][name.removeprefix("tensors/")]["storage"]).itemsize
            total += self.group_bounds(name)[-1] * size
        return total


class ShardFile:
    """An open shard (a low-level HDF5 file id); use as a context manager."""

    def __init__(self, fid: Any, path: Path):
        self.fid, self.path = fid, path

    def close(self) -> None:
        if self.fid is not None:
            h5io.close(self.fid)
            self.fid = None

    def __enter__(self) -> ShardFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_shard(path: Path) -> ShardFile:
    """Open a shard read-only (no HDF5 file locking: Lustre and NFS). A file that does not open is corrupt."""
    try:
        return ShardFile(h5io.open_file(path), path)
    except FileNotFoundError:
        raise
    except Exception as exc:  # truncated or garbled files raise OSError, ValueError, RuntimeError ...
        if not path.exists():
            raise FileNotFoundError(str(path)) from None
        raise CorruptShardError(f"{path}: cannot open as HDF5 ({exc})") from None


def read_header(f: ShardFile, path: Path) -> ShardHeader:
    """Read and verify the header and index of an open shard; :class:`CorruptShardError` if they do not check out."""
    try:
        expected = h5io.read_int_attr(f.fid, "header_crc")
        hds, hshape, htype = h5io.open_vector(f.fid, "header")
        ids, ishape, itype = h5io.open_vector(f.fid, "index")
        if htype != np.uint8 or len(hshape) != 1 or hshape[0] > MAX_HEADER_BYTES or itype != np.int64:
            raise CorruptShardError(f"{path}: header or index dataset has the wrong type")
        header = np.empty(hshape, htype)
        h5io.read_whole(hds, header)
        header_bytes = header.tobytes()
        index = np.empty(ishape, itype)
        h5io.read_whole(ids, index)
        return _parse_header(header_bytes, index, expected, path)
    except CorruptShardError:
        raise
    except Exception as exc:
        raise CorruptShardError(f"{path}: unreadable header ({type(exc).__name__}: {exc})") from None


def _parse_header(header_bytes: bytes, index: np.ndarray, expected_crc: int, path: Path | str) -> ShardHeader:
    if zlib.crc32(index.data, zlib.crc32(header_bytes)) != expected_crc & 0xFFFFFFFF:
        raise CorruptShardError(f"{path}: header checksum mismatch")
    meta = json.loads(header_bytes)
    if meta.get("format") != FORMAT:
        raise CorruptShardError(f"{path}: not a {FORMAT} shard (format={meta.get('format')!r})")
    sections: dict[str, np.ndarray] = {}
    pos = 0
    for name, length in meta["index"]:
        sections[name] = index[pos : pos + length]
        pos += length
    if pos != index.shape[0]:
        raise CorruptShardError(f"{path}: index length does not match its layout")
    return ShardHeader(meta, sections)


@dataclass
class LoadedShard:
    """A whole small shard in memory (:func:`load_small`)."""

    header: ShardHeader
    columns: dict[str, np.ndarray]
    """Every data dataset, whole (views of one buffer)."""
    nbytes: int
    """The memory the columns hold (the file's size)."""


def load_small(path: Path | str, max_bytes: int) -> LoadedShard | None:
    """The verified header and every data column of a shard of at most ``max_bytes`` laid out as
    :mod:`~relax_hpc.store.h5raw` lays files out (text shards), read with one system call and without the HDF5
    library; group checksums are verified by :func:`read_groups` (``columns=``). None for anything else, including
    any damage: read such a shard with the library (:func:`open_shard`), which names the problem.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            return None
        buf = bytearray(size)
        if os.readv(fd, [buf]) != size:
            return None
    except OSError:
        return None
    finally:
        os.close(fd)
    found = h5raw.locate(buf)
    if found is None or "header_crc" not in found[1]:
        return None
    datasets, attrs = found
    try:
        cols = {
            name: np.frombuffer(buf, dtype, length, at) if length else np.empty(0, dtype)
            for name, (at, length, dtype) in datasets.items()
        }
        header_bytes, index = cols.pop("header"), cols.pop("index")
        if header_bytes.dtype != np.uint8 or index.dtype != np.int64:
            return None
        header = _parse_header(header_bytes.tobytes(), index.copy(), attrs["header_crc"], path)
        if header.data_bytes() is None or sorted(cols) != sorted(header.meta["datasets"]):
            return None
        if any(cols[name].shape[0] != header.group_bounds(name)[-1] for name in cols):
            return None
    except Exception:
        return None
    return LoadedShard(header, cols, size)


class _CrcPipeline:
    """Digests computed on a helper thread while the main thread reads the next piece (numpy and zlib release the
    GIL). Jobs run in submission order, so a digest chained over several pieces of one group comes out right.
    """

    def __init__(self) -> None:
        self.values: dict[tuple[int, int], int] = {}
        self._queue: queue.SimpleQueue[tuple[tuple[int, int], np.ndarray] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            key, view = job
            try:
                self.values[key] = blocksum(view, self.values.get(key, 0))
            except BaseException as exc:  # reported by join()
                self._error = exc

    def submit(self, key: tuple[int, int], view: np.ndarray) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="relax-crc", daemon=True)
            self._thread.start()
        self._queue.put((key, view))

    def join(self) -> dict[tuple[int, int], int]:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self.values


@dataclass
class GroupsRead:
    """Samples of the groups that verified, and the indices of groups that failed their checksum."""

    samples: list[Sample]
    bad_groups: list[int]
    bad_samples: int


def read_columns(f: ShardFile, header: ShardHeader, path: Path) -> dict[str, np.ndarray]:
    """Every data dataset of a shard without big tensors (``header.data_bytes()`` is not None), whole, one read
    each; checked as :func:`read_groups` checks them. Pass them to :func:`read_groups` as ``columns`` to read any
    groups without the file: checksums are verified there."""
    if header.data_bytes() is None:
        raise ValueError(f"{path}: a shard with big tensors is read group by group")
    cols: dict[str, np.ndarray] = {}
    try:
        for name in header.meta["datasets"]:
            ds, shape, dtype = h5io.open_vector(f.fid, name)
            n = header.group_bounds(name)[-1]
            if shape != (n,):
                raise CorruptShardError(f"{path}: dataset {name} has shape {shape}, index says ({n},)")
            out = np.empty(n, dtype)
            h5io.read_whole(ds, out)
            cols[name] = out
    except CorruptShardError:
        raise
    except Exception as exc:
        raise CorruptShardError(f"{path}: unreadable data ({type(exc).__name__}: {exc})") from None
    return cols


def read_groups(
    f: ShardFile | None,
    header: ShardHeader,
    path: Path,
    g0: int,
    g1: int,
    *,
    verify: bool = True,
    columns: dict[str, np.ndarray] | None = None,
) -> GroupsRead:
    """Read groups ``[g0, g1)`` of an open shard (or slice them from its ``columns``, :func:`read_columns`; then
    ``f`` is not used), then verify each group's checksums.

    One read per dataset; big tensors are read sample by sample in pieces of at most ``PIECE_BYTES`` while a helper
    thread digests the pieces already read.
    """
    if not 0 <= g0 <= g1 <= header.num_groups:
        raise CorruptShardError(f"{path}: group range [{g0}, {g1}) outside 0..{header.num_groups}")
    if columns is not None:
        cols: dict[str, np.ndarray] = {}
        bases: dict[str, int] = {}
        for name in header.meta["datasets"]:
            b = header.group_bounds(name)
            cols[name], bases[name] = columns[name][b[g0] : b[g1]], b[g0]
        digested: dict[tuple[int, int], int] = {}
    else:
        assert f is not None
        cols, bases, digested = _read_range(f, header, path, g0, g1, verify=verify)
    bad = _bad_groups(header, cols, bases, digested, g0, g1) if verify else []
    keep = [gi for gi in range(g0, g1) if gi not in bad] if bad else list(range(g0, g1))
    samples = _build_samples(header, cols, bases, keep, path) if keep else []
    goff = header.sample_lists[0]
    return GroupsRead(samples, bad, sum(goff[gi + 1] - goff[gi] for gi in bad))


def _read_range(
    f: ShardFile, header: ShardHeader, path: Path, g0: int, g1: int, *, verify: bool
) -> tuple[dict[str, np.ndarray], dict[str, int], dict[tuple[int, int], int]]:
    """Groups ``[g0, g1)`` of every data dataset, and the digests of the big tensors' groups (computed while
    reading, on a helper thread)."""
    datasets: list[str] = header.meta["datasets"]
    digests: dict[str, str] = header.meta.get("digests", {})
    goff = header.sample_lists[0]
    cols: dict[str, np.ndarray] = {}
    bases: dict[str, int] = {}
    digested: dict[tuple[int, int], int] = {}
    pipe = _CrcPipeline()
    try:
        try:
            for d, name in enumerate(datasets):
                ds = h5io.open_dataset(f.fid, name)
                b = header.group_bounds(name)
                if ds.rank != 1 or ds.shape[0] != b[-1]:
                    raise CorruptShardError(f"{path}: dataset {name} has shape {ds.shape}, index says ({b[-1]},)")
                lo, hi = b[g0], b[g1]
                out = np.empty(hi - lo, ds.dtype)
                cols[name], bases[name] = out, lo
                if name not in digests:  # crc32 per group, after one read
                    h5io.read_into(ds, lo, out)
                    continue
                if digests[name] != BLOCKSUM:
                    raise CorruptShardError(f"{path}: unknown digest {digests[name]!r} for dataset {name}")
                # big tensors: sample by sample, in pieces that are multiples of the digest block
                so = header.sample_offsets(name).tolist()
                step = PIECE_BYTES // out.itemsize
                for gi in range(g0, g1):
                    for i in range(goff[gi], goff[gi + 1]):
                        for a in range(so[i], so[i + 1], step):
                            view = out[a - lo : min(a + step, so[i + 1]) - lo]
                            h5io.read_into(ds, a, view)
                            if verify:
                                pipe.submit((gi, d), view)
        finally:
            digested.update(pipe.join())
    except CorruptShardError:
        raise
    except Exception as exc:
        raise CorruptShardError(f"{path}: unreadable data ({type(exc).__name__}: {exc})") from None
    return cols, bases, digested


def _bad_groups(
    header: ShardHeader,
    cols: dict[str, np.ndarray],
    bases: dict[str, int],
    digested: dict[tuple[int, int], int],
    g0: int,
    g1: int,
) -> list[int]:
    """Groups of ``[g0, g1)`` whose slice of some dataset does not match its checksum."""
    digests: dict[str, str] = header.meta.get("digests", {})
    expected = (header.group_crc()[g0:g1] & 0xFFFFFFFF).T.tolist()
    bad: set[int] = set()
    for d, name in enumerate(header.meta["datasets"]):
        if name in digests:
            got = [digested.get((gi, d), 0) for gi in range(g0, g1)]
        else:
            col, base, b = cols[name], bases[name], header.group_bounds(name)
            data, k = memoryview(col.view(np.uint8)), col.itemsize  # type: ignore[arg-type]  # ndarrays are buffers
            got = list(map(zlib.crc32, [data[(b[gi] - base) * k : (b[gi + 1] - base) * k] for gi in range(g0, g1)]))
        if got != expected[d]:
            bad.update(g0 + i for i, (x, y) in enumerate(zip(got, expected[d])) if x != y)
    return sorted(bad)


def _group_docs(header: ShardHeader, raw: bytes, base: int, groups: list[int], path: Path) -> list[list[Any]]:
    """The JSON records of each of ``groups`` (one parse for all of them; group by group to name a bad one)."""
    goff, jg = header.sample_lists[0], header.sample_lists[3]
    parts = [raw[jg[gi] - base : jg[gi + 1] - base] for gi in groups]
    try:
        docs = json.loads(b"[" + b",".join(parts) + b"]")
    except ValueError:
        docs = None
    if docs is not None and len(docs) == len(groups):
        for k, gi in enumerate(groups):
            if type(docs[k]) is not list or len(docs[k]) != goff[gi + 1] - goff[gi]:
                break
        else:
            return docs
    for k, gi in enumerate(groups):  # find the first bad group for the message
        try:
            group_docs = json.loads(parts[k])
        except ValueError as exc:
            raise CorruptShardError(f"{path}: group {gi} has unreadable JSON ({exc})") from None
        n = goff[gi + 1] - goff[gi]
        if not isinstance(group_docs, list) or len(group_docs) != n:
            count = len(group_docs) if isinstance(group_docs, list) else "no list of"
            raise CorruptShardError(f"{path}: group {gi} has {count} JSON records for {n} samples")
    raise CorruptShardError(f"{path}: unreadable JSON")


def _build_samples(
    header: ShardHeader, cols: dict[str, np.ndarray], bases: dict[str, int], groups: list[int], path: Path
) -> list[Sample]:
    """Samples of ``groups`` from their columns, field by field (views of the columns, no copies)."""
    goff, po, ro, _, v, vf, vl = header.sample_lists
    P, R, M, L = cols["prompt_ids"], cols["response_ids"], cols["loss_mask"], cols["logprobs"]
    pb, rb, s0 = bases["prompt_ids"], bases["response_ids"], bases["reward"]
    per_group = _group_docs(header, cols["sample_json"].tobytes(), bases["sample_json"], groups, path)
    docs = [d for ds in per_group for d in ds]
    ids = [i for gi in groups for i in range(goff[gi], goff[gi + 1])]
    rewards = cols["reward"].tolist()
    response = [(ro[i] - rb, ro[i + 1] - rb) for i in ids]
    samples = list(
        map(
            Sample,
            [P[po[i] - pb : po[i + 1] - pb] for i in ids],
            [R[a:b] for a, b in response],
            [L[a:b] for a, b in response],
            [rewards[i - s0] for i in ids],
            [M[a:b] for a, b in response],
            [v[i] for i in ids],
            [vf[i] for i in ids],
            [vl[i] for i in ids],
            [d["r"] if "r" in d else {} for d in docs],  # noqa: SIM401 (no method call per sample)
            [d["t"] if "t" in d else {} for d in docs],  # noqa: SIM401
            [d["m"] if "m" in d else {} for d in docs],  # noqa: SIM401
            [{} for _ in ids],
            [{} for _ in ids],
            [header.meta["group_ids"][gi] for gi in groups for _ in range(goff[gi], goff[gi + 1])],
        )
    )
    if TURNS in cols:
        _set_turns(header, cols[TURNS], bases[TURNS], samples, ids)
    for tname, spec in header.meta["tensors"].items():
        key = f"tensors/{tname}"
        nd, dtype, tb = int(spec["max_ndim"]), spec["dtype"], bases[key]
        buf = cols[key].view(np.bool_) if dtype == "bool" else cols[key]
        shapes = header.sections[f"{tname}.shape"].reshape(-1, nd + 1).tolist()
        toff = header.sections[f"{tname}.offsets"].tolist()
        for s, i in zip(samples, ids):
            row = shapes[i]
            if row[0] >= 0:
                s.tensors[tname] = buf[toff[i] - tb : toff[i + 1] - tb].reshape(row[1 : 1 + row[0]])
                s.tensor_dtypes[tname] = dtype
    return samples


def _set_turns(header: ShardHeader, col: np.ndarray, base: int, samples: list[Sample], ids: list[int]) -> None:
    """Each sample's ``[T, 2]`` turn boundaries (views of the column; None for a sample stored without)."""
    counts = header.sections["turn_counts"].tolist()
    toff = header.turn_offsets.tolist()
    for s, i in zip(samples, ids):
        if counts[i] >= 0:
            s.turns = col[toff[i] - base : toff[i + 1] - base].reshape(counts[i], 2)


def read_shard(path: Path | str, *, verify: bool = True) -> list[Sample]:
    """Every sample of one shard (a tool for operators and tests). :class:`CorruptShardError` on any damage."""
    path = Path(path)
    with open_shard(path) as f:
        header = read_header(f, path)
        res = read_groups(f, header, path, 0, header.num_groups, verify=verify)
    if res.bad_groups:
        raise CorruptShardError(f"{path}: checksum mismatch in group(s) {res.bad_groups}")
    return res.samples
