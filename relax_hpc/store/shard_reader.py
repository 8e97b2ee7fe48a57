"""Reading ``relax-hpc-shard/1`` files: verified header, then one read per dataset for a run of groups.

Opening never takes HDF5 file locks (Lustre without ``-o flock``, NFS). Anything that does not open or does not
verify raises :class:`CorruptShardError`; a group whose checksum fails is reported, never returned.
"""

from __future__ import annotations

import json
import queue
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.errors import CorruptShardError
from relax_hpc.store import h5io
from relax_hpc.store.sample import Sample
from relax_hpc.store.shard import BLOCKSUM, FORMAT, MAX_HEADER_BYTES, OFFSETS_OF, blocksum, crc

#: Datasets bigger than this (in this read) are read in pieces of this size, checksummed on a helper thread.
PIECE_BYTES = 8 << 20  # a multiple of DIGEST_BLOCK


@dataclass
class ShardHeader:
    """The verified header and index of a shard (everything but the data)."""

    meta: dict[str, Any]
    sections: dict[str, np.ndarray]

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
        return self.sections[OFFSETS_OF[dataset]]

    def group_bounds(self, dataset: str) -> list[int]:
        """Element offsets (G+1) of a data dataset at group boundaries."""
        if dataset == "sample_json":
            return self.sections["json_group_offsets"].tolist()
        return self.sample_offsets(dataset)[self.group_offsets].tolist()


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
        hds, ids = h5io.open_dataset(f.fid, "header"), h5io.open_dataset(f.fid, "index")
        if hds.dtype != np.uint8 or hds.rank != 1 or hds.shape[0] > MAX_HEADER_BYTES or ids.dtype != np.int64:
            raise CorruptShardError(f"{path}: header or index dataset has the wrong type")
        header_bytes = h5io.read_all(hds).tobytes()
        index = h5io.read_all(ids)
        if zlib.crc32(index.data, zlib.crc32(header_bytes)) != expected & 0xFFFFFFFF:
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
    except CorruptShardError:
        raise
    except Exception as exc:
        raise CorruptShardError(f"{path}: unreadable header ({type(exc).__name__}: {exc})") from None


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


def read_groups(f: ShardFile, header: ShardHeader, path: Path, g0: int, g1: int, *, verify: bool = True) -> GroupsRead:
    """Read groups ``[g0, g1)`` of an open shard, then verify each group's checksums.

    One read per dataset; big tensors are read sample by sample in pieces of at most ``PIECE_BYTES`` while a helper
    thread digests the pieces already read.
    """
    if not 0 <= g0 <= g1 <= header.num_groups:
        raise CorruptShardError(f"{path}: group range [{g0}, {g1}) outside 0..{header.num_groups}")
    datasets: list[str] = header.meta["datasets"]
    digests: dict[str, str] = header.meta.get("digests", {})
    goff = header.group_offsets.tolist()
    crc_table = header.group_crc() if verify else None
    cols: dict[str, np.ndarray] = {}
    bases: dict[str, int] = {}
    computed: dict[tuple[int, int], int] = {}
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
                if name not in digests:  # crc32 per group over one read
                    h5io.read_into(ds, lo, out)
                    if crc_table is not None:
                        for gi in range(g0, g1):
                            computed[(gi, d)] = crc(out[b[gi] - lo : b[gi + 1] - lo])
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
                            if crc_table is not None:
                                pipe.submit((gi, d), view)
        finally:
            computed.update(pipe.join())
    except CorruptShardError:
        raise
    except Exception as exc:
        raise CorruptShardError(f"{path}: unreadable data ({type(exc).__name__}: {exc})") from None
    bad = []
    if crc_table is not None:
        for gi in range(g0, g1):
            for d in range(len(datasets)):
                if computed.get((gi, d), 0) != int(crc_table[gi, d]) & 0xFFFFFFFF:
                    bad.append(gi)
                    break
    keep = [gi for gi in range(g0, g1) if gi not in bad]
    samples = _build_samples(header, cols, bases, keep, goff[g0], path) if keep else []
    return GroupsRead(samples, bad, sum(goff[gi + 1] - goff[gi] for gi in bad))


def _build_samples(
    header: ShardHeader, cols: dict[str, np.ndarray], bases: dict[str, int], groups: list[int], s0: int, path: Path
) -> list[Sample]:
    sec = header.sections
    goff = header.group_offsets.tolist()
    po, ro = sec["prompt_offsets"].tolist(), sec["response_offsets"].tolist()
    jg = sec["json_group_offsets"].tolist()
    v, vf, vl = sec["version"].tolist(), sec["version_first"].tolist(), sec["version_last"].tolist()
    P, R, M, L = cols["prompt_ids"], cols["response_ids"], cols["loss_mask"], cols["logprobs"]
    rewards = cols["reward"].tolist()
    pb, rb, jb = bases["prompt_ids"], bases["response_ids"], bases["sample_json"]
    js = cols["sample_json"]
    group_ids = header.meta["group_ids"]
    tensor_views = []
    for tname, spec in header.meta["tensors"].items():
        key = f"tensors/{tname}"
        nd = int(spec["max_ndim"])
        buf = cols[key].view(np.bool_) if spec["dtype"] == "bool" else cols[key]
        shapes = sec[f"{tname}.shape"].reshape(-1, nd + 1).tolist()
        tensor_views.append((tname, spec["dtype"], buf, sec[f"{tname}.offsets"].tolist(), shapes, bases[key]))
    out: list[Sample] = []
    for gi in groups:
        a, b = goff[gi], goff[gi + 1]
        try:
            docs = json.loads(js[jg[gi] - jb : jg[gi + 1] - jb].tobytes())
        except ValueError as exc:
            raise CorruptShardError(f"{path}: group {gi} has unreadable JSON ({exc})") from None
        if len(docs) != b - a:
            raise CorruptShardError(f"{path}: group {gi} has {len(docs)} JSON records for {b - a} samples")
        gid = group_ids[gi]
        for i in range(a, b):
            doc = docs[i - a]
            r0, r1 = ro[i] - rb, ro[i + 1] - rb
            s = Sample(
                P[po[i] - pb : po[i + 1] - pb],
                R[r0:r1],
                L[r0:r1],
                rewards[i - s0],
                M[r0:r1],
                v[i],
                vf[i],
                vl[i],
                doc.get("r", {}),
                doc.get("t", {}),
                doc.get("m", {}),
                {},
                {},
                gid,
                False,
            )
            for tname, dtype, buf, toff, shapes, tb in tensor_views:
                row = shapes[i]
                if row[0] >= 0:
                    s.tensors[tname] = buf[toff[i] - tb : toff[i + 1] - tb].reshape(row[1 : 1 + row[0]])
                    s.tensor_dtypes[tname] = dtype
            out.append(s)
    return out


def read_shard(path: Path | str, *, verify: bool = True) -> list[Sample]:
    """Every sample of one shard (a tool for operators and tests). :class:`CorruptShardError` on any damage."""
    path = Path(path)
    with open_shard(path) as f:
        header = read_header(f, path)
        res = read_groups(f, header, path, 0, header.num_groups, verify=verify)
    if res.bad_groups:
        raise CorruptShardError(f"{path}: checksum mismatch in group(s) {res.bad_groups}")
    return res.samples
