"""The HDF5 shard format (``relax-hpc-shard/1``): columnar, contiguous, checksummed per group.

A shard holds ``G`` complete prompt groups, ``N`` samples in all, group after group. Every variable-length field is
one flat dataset (all samples concatenated) located by offsets, so a shard is ~10 HDF5 objects whatever ``N`` is::

    attrs  format="relax-hpc-shard/1", header_crc=crc32(header bytes + index bytes)
    header       uint8[]   JSON: writer_id, seq, num_samples, num_groups, group_ids, datasets (checksum order),
                           index sections [[name, length], ...], tensors {name: {dtype, storage, max_ndim}}
    index        int64[]   the sections, concatenated: group_offsets (G+1), group_crc (G*D), version,
                           version_first, version_last (N each), prompt_offsets, response_offsets (N+1 each),
                           json_group_offsets (G+1), per tensor t: t.offsets (N+1),
                           t.shape (N*(max_ndim+1): ndim or -1 if the sample has no such tensor, then dims)
    prompt_ids   int32[]   response_ids int32[], loss_mask uint8[], logprobs float32[] (response offsets)
    reward       float64[N]
    sample_json  uint8[]   per group, a JSON list of ``{"r": rewards, "t": timings, "m": metadata}`` per sample
    tensors/<t>  storage dtype[]  flattened tensors (bf16 as uint16 bits)

``group_crc[g, d]`` is the crc32 of group ``g``'s slice of data dataset ``d`` (for the big tensors the header lists
under ``digests``: the :func:`blocksum` digest chained over the group's samples), so a rank reading some groups verifies
exactly what it read, and a bit flip costs the one group it hits (the shard is quarantined). The header check covers
everything needed to locate data; a shard whose header fails, or that does not open (truncated), is corrupt whole.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.errors import SampleValidationError
from relax_hpc.store import h5io, h5raw
from relax_hpc.store.sample import CheckedColumns, SampleGroup, check_columns, check_sample

FORMAT = "relax-hpc-shard/1"
OFFSETS_OF = {
    "prompt_ids": "prompt_offsets",
    "response_ids": "response_offsets",
    "loss_mask": "response_offsets",
    "logprobs": "response_offsets",
}
TURNS = "turns"
"""The optional turn-boundary column: (start, end) int32 pairs, located by the ``turn_counts`` index section."""
#: Tensors averaging at least this many bytes per sample are written sample by sample (no concatenation copy).
SLICE_WRITE_BYTES = 1 << 20
DIGEST_BLOCK = 4096
BLOCKSUM = "blocksum64-4k"
MAX_HEADER_BYTES = 64 << 20
_JSON = json.JSONEncoder(separators=(",", ":"), check_circular=False)  # a cycle: RecursionError
#: Shards without tensors and with at most this many data bytes are laid out in memory and written with one system call.
IMAGE_BYTES = 16 << 20


def blocksum(arr: np.ndarray, value: int = 0) -> int:
    """The ``blocksum64-4k`` digest of big tensors: crc32 of the uint64 sums of each full 4 KiB block, then of the
    tail bytes. ~3x faster than crc32 over the bytes; catches any single bit flip, truncation, zeroed or reordered
    blocks. Chaining over pieces equals the digest of their concatenation when every piece but the last is a multiple
    of 4 KiB long."""
    b = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    n = b.size - b.size % DIGEST_BLOCK
    if n:
        sums = b[:n].view("<u8").reshape(-1, DIGEST_BLOCK // 8).sum(axis=1, dtype=np.uint64)
        value = zlib.crc32(sums.astype("<u8", copy=False).data, value)
    return zlib.crc32(b[n:].data, value)


@dataclass
class EncodedShard:
    """A validated shard ready to write: every dataset as arrays, plus the header. Building it touches no file."""

    header: dict[str, Any]
    index: np.ndarray
    columns: dict[str, np.ndarray | list[np.ndarray]]
    num_samples: int
    num_groups: int
    min_version: int
    max_version: int
    nbytes: int

    def write(self, path: Path, *, fsync: bool = True) -> None:
        """Write the shard to ``path`` (a new file) and fsync it. OSError propagates (the caller names the file).

        A shard without tensors of at most ``IMAGE_BYTES`` (and at most ``h5raw.MAX_DATASETS`` datasets) is laid out
        in memory (:mod:`~relax_hpc.store.h5raw`) and written with one system call; any other is written by the
        HDF5 library, big tensors sample by sample.
        """
        header_bytes = json.dumps(self.header, separators=(",", ":")).encode()
        if self.nbytes <= IMAGE_BYTES and not self.header["tensors"] and len(self.columns) + 2 <= h5raw.MAX_DATASETS:
            self._write_image(path, header_bytes, fsync=fsync)
            return
        fid = h5io.create_file(path)
        try:
            self._fill(fid, header_bytes)
        except BaseException:
            h5io.abandon(fid)
            raise
        try:
            h5io.close(fid)  # flushes HDF5 metadata: may hit a full disk too
        except BaseException:
            h5io.abandon(fid)
            raise
        if fsync:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _write_image(self, path: Path, header_bytes: bytes, *, fsync: bool) -> None:
        datasets = {"header": np.frombuffer(header_bytes, np.uint8), "index": self.index}
        datasets.update(self.columns)  # type: ignore[arg-type]  # every column is one array here
        crc = zlib.crc32(self.index.data, zlib.crc32(header_bytes))
        attrs: dict[str, int | bytes] = {"format": FORMAT.encode(), "header_crc": crc}
        image = memoryview(h5raw.build_image(datasets, attrs))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            while image:
                image = image[os.write(fd, image) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _fill(self, fid: Any, header_bytes: bytes) -> None:
        h5io.write_attr(fid, "format", FORMAT)
        h5io.write_attr(fid, "header_crc", zlib.crc32(self.index.data, zlib.crc32(header_bytes)))
        h5io.write_dataset(fid, "header", np.frombuffer(header_bytes, np.uint8))
        h5io.write_dataset(fid, "index", self.index)
        for name, col in self.columns.items():
            if isinstance(col, np.ndarray):
                h5io.write_dataset(fid, name, col)
                continue
            ds = h5io.create_dataset(fid, name, col[0].dtype, sum(a.size for a in col))
            pos = 0
            for a in col:
                h5io.write_slice(ds, pos, a.reshape(-1))
                pos += a.size


def _offsets(lengths: list[int]) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


class _Where(Sequence[str]):
    """``group '<id>' sample <i>`` for every sample of a shard, formatted only when an error message needs it."""

    def __init__(self, group_ids: list[str], group_offsets: list[int]):
        self._ids, self._goff = group_ids, group_offsets

    def __len__(self) -> int:
        return self._goff[-1]

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not 0 <= i < len(self):
            raise IndexError(i)
        g = bisect.bisect_right(self._goff, i) - 1
        return f"group {self._ids[g]!r} sample {i - self._goff[g]}"


def _first_bad(arrays: list[np.ndarray], where: Sequence[str], bad: Any) -> str:
    for a, w in zip(arrays, where, strict=True):
        if bad(a):
            return w
    return "a sample"


def _token_column(arrays: list[np.ndarray], name: str, where: Sequence[str]) -> np.ndarray:
    """Concatenate token ids as int32; only dtypes wider than int32 pay for a range check."""
    if not arrays:
        return np.zeros(0, np.int32)
    dtypes = {a.dtype for a in arrays}
    if all(np.can_cast(dt, np.int32) for dt in dtypes):
        return np.concatenate(arrays, dtype=np.int32, casting="safe")
    wide = np.concatenate(arrays)
    lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    if wide.size and (int(wide.min()) < lo or int(wide.max()) > hi):
        w = _first_bad(arrays, where, lambda a: a.size and (a.min() < lo or a.max() > hi))
        raise SampleValidationError(f"{w}: field '{name}' has token ids outside the int32 range")
    return wide.astype(np.int32)


def _mask_column(arrays: list[np.ndarray], where: Sequence[str]) -> np.ndarray:
    if not arrays:
        return np.zeros(0, np.uint8)
    mask = np.concatenate(arrays, dtype=np.uint8, casting="unsafe")
    dtypes = {a.dtype for a in arrays}
    if dtypes != {np.dtype(np.bool_)}:
        exact = mask if dtypes == {np.dtype(np.uint8)} else np.concatenate(arrays).astype(np.int64)
        if exact.size and (int(exact.min()) < 0 or int(exact.max()) > 1):
            w = _first_bad(arrays, where, lambda a: a.size and (a.min() < 0 or a.max() > 1))
            raise SampleValidationError(f"{w}: field 'loss_mask' must hold only 0 and 1")
    return mask


def _group_json(docs: list[dict[str, Any]], where: Sequence[str], first: int) -> bytes:
    """One group's JSON records (``where[first + k]`` names sample ``k`` of the group in an error)."""
    try:
        return _JSON.encode(docs).encode()
    except (TypeError, ValueError, RecursionError):
        for k, doc in enumerate(docs):
            try:
                json.dumps(doc)
            except (TypeError, ValueError) as exc:
                raise SampleValidationError(
                    f"{where[first + k]}: field 'metadata' is not JSON-serialisable: {exc}"
                ) from None
        raise


def _tensor_columns(
    tensors: list[dict[str, tuple[np.ndarray, str]]], where: Sequence[str]
) -> tuple[dict[str, Any], ...]:
    """Per tensor name: the column (array, or per-sample arrays for big tensors), element offsets, spec, sections."""
    n = len(tensors)
    columns: dict[str, np.ndarray | list[np.ndarray]] = {}
    offsets_of: dict[str, np.ndarray] = {}
    carriers: dict[str, list[int]] = {}  # sample-by-sample columns: indices of the samples that carry the tensor
    specs: dict[str, dict[str, Any]] = {}
    sections: dict[str, np.ndarray] = {}
    for tname in sorted({t for ts in tensors for t in ts}):
        present = [(i, ts[tname]) for i, ts in enumerate(tensors) if tname in ts]
        storage, logical = present[0][1][0].dtype, present[0][1][1]
        max_nd = max(arr.ndim for _, (arr, _) in present)
        shape = np.full((n, max_nd + 1), -1, np.int64)
        sizes = [0] * n
        for i, (arr, lg) in present:
            if arr.dtype != storage or lg != logical:
                raise SampleValidationError(
                    f"{where[i]}: tensor '{tname}' is {lg} but earlier samples of the shard "
                    f"have {logical} (one dtype per tensor name per shard)"
                )
            shape[i, 0] = arr.ndim
            shape[i, 1 : 1 + arr.ndim] = arr.shape
            shape[i, 1 + arr.ndim :] = 0
            sizes[i] = arr.size
        offsets = _offsets(sizes)
        key = f"tensors/{tname}"
        arrays = [arr.reshape(-1) for _, (arr, _) in present]
        if int(offsets[-1]) * storage.itemsize >= SLICE_WRITE_BYTES * len(present):
            columns[key] = arrays
            carriers[key] = [i for i, _ in present]
        else:
            columns[key] = np.concatenate(arrays) if arrays else np.zeros(0, storage)
        offsets_of[key] = offsets
        specs[tname] = {"dtype": logical, "storage": storage.name, "max_ndim": max_nd}
        sections[f"{tname}.offsets"] = offsets
        sections[f"{tname}.shape"] = shape.reshape(-1)
    return columns, offsets_of, carriers, specs, sections


def _turn_column(
    turns: list[np.ndarray | None], columns: dict[str, np.ndarray | list[np.ndarray]]
) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """The ``turns`` column (when any sample has turn boundaries): (start, end) pairs, flat, int32, added to
    ``columns``; returns the ``turn_counts`` index section (turns per sample, -1 for a sample without) and the
    column's element offsets, or ({}, None) for a shard without turns (laid out as before the column existed)."""
    if all(t is None for t in turns):
        return {}, None
    counts = np.array([-1 if t is None else t.shape[0] for t in turns], np.int64)
    columns["turns"] = np.concatenate([t.reshape(-1) for t in turns if t is not None], dtype=np.int32)
    return {"turn_counts": counts}, _offsets((2 * np.maximum(counts, 0)).tolist())


def _group_digests(
    col: np.ndarray | list[np.ndarray], bounds: list[int], goff: list[int], carriers: list[int] | None
) -> list[int]:
    """The checksum of each group's slice of one data dataset."""
    if isinstance(col, np.ndarray):
        data = memoryview(np.ascontiguousarray(col).view(np.uint8))  # type: ignore[arg-type]  # ndarrays are buffers
        k = col.itemsize
        return [zlib.crc32(data[a * k : b * k]) for a, b in itertools.pairwise(bounds)]
    assert carriers is not None  # big tensors kept per sample: the blocksum digest chained over a group's samples
    by_sample = dict(zip(carriers, col, strict=True))
    out = []
    for a, b in itertools.pairwise(goff):
        value = 0
        for i in range(a, b):
            if i in by_sample:
                value = blocksum(by_sample[i], value)
        out.append(value)
    return out


def _group_problem(gi: int, group: Any) -> str:
    if not isinstance(group, SampleGroup):
        return f"group {gi}: expected a SampleGroup, got {type(group).__name__}"
    if not isinstance(group.group_id, str) or not group.group_id:
        return f"group {gi}: group_id must be a non-empty string, got {group.group_id!r}"
    if not group.samples:
        return f"group {group.group_id!r}: a group needs at least one sample"
    return ""


def encode_shard(groups: list[SampleGroup], *, writer_id: str, seq: int) -> EncodedShard:
    """Validate ``groups`` and lay them out as a shard. Raises :class:`SampleValidationError` naming the field."""
    if isinstance(groups, SampleGroup):
        groups = [groups]
    if not groups:
        raise SampleValidationError("a shard needs at least one group")
    group_ids: list[str] = []
    group_sizes: list[int] = []
    for gi, group in enumerate(groups):
        problem = _group_problem(gi, group)
        if problem:  # a problem in a sample of an earlier group is reported first
            before = _Where(group_ids, _offsets(group_sizes).tolist())
            for i, sample in enumerate(s for earlier in groups[:gi] for s in earlier.samples):
                check_sample(sample, before[i])
            raise SampleValidationError(problem)
        group_ids.append(group.group_id)
        group_sizes.append(len(group.samples))
    group_off = _offsets(group_sizes)
    goff = group_off.tolist()
    where = _Where(group_ids, goff)
    samples = [s for group in groups for s in group.samples]
    checked = check_columns(samples)
    if checked is None:
        checked = CheckedColumns.of([check_sample(s, where[i]) for i, s in enumerate(samples)])
    n, g = len(samples), len(groups)
    prompts, responses = checked.prompt_ids, checked.response_ids
    columns: dict[str, np.ndarray | list[np.ndarray]] = {
        "prompt_ids": _token_column(prompts, "prompt_ids", where),
        "response_ids": _token_column(responses, "response_ids", where),
        "loss_mask": _mask_column(checked.loss_mask, where),
        "logprobs": np.concatenate(checked.logprobs, dtype=np.float32, casting="same_kind"),
        "reward": np.array(checked.reward, np.float64),
    }
    json_parts = [_group_json(checked.doc[a:b], where, a) for a, b in itertools.pairwise(goff)]
    columns["sample_json"] = np.frombuffer(b"".join(json_parts), np.uint8)
    prompt_off = _offsets([a.shape[0] for a in prompts])
    response_off = _offsets([a.shape[0] for a in responses])
    json_group_off = _offsets([len(p) for p in json_parts])
    turn_sections, turn_off = _turn_column(checked.turns, columns)
    tcols, toffsets, carriers, tspecs, tsections = _tensor_columns(checked.tensors, where)
    columns.update(tcols)
    # element offsets at group boundaries, per dataset
    bounds = {"sample_json": json_group_off, "reward": group_off}
    for name, off in (
        ("prompt_ids", prompt_off),
        ("response_ids", response_off),
        ("loss_mask", response_off),
        ("logprobs", response_off),
        *([("turns", turn_off)] if turn_off is not None else []),
        *toffsets.items(),
    ):
        bounds[name] = off[group_off]
    datasets = list(columns)
    crcs = np.array([_group_digests(columns[d], bounds[d].tolist(), goff, carriers.get(d)) for d in datasets])
    v = np.array(checked.version, np.int64)
    sections: dict[str, np.ndarray] = {
        "group_offsets": group_off,
        "group_crc": crcs.T.reshape(-1),
        "version": v,
        "version_first": np.array(checked.version_first, np.int64),
        "version_last": np.array(checked.version_last, np.int64),
        "prompt_offsets": prompt_off,
        "response_offsets": response_off,
        "json_group_offsets": json_group_off,
        **turn_sections,
        **tsections,
    }
    index = np.concatenate([np.asarray(a, np.int64) for a in sections.values()])
    header = {
        "format": FORMAT,
        "writer_id": writer_id,
        "seq": seq,
        "num_samples": n,
        "num_groups": g,
        "created": time.time(),
        "group_ids": group_ids,
        "datasets": datasets,
        "index": [[name, int(a.size)] for name, a in sections.items()],
        "tensors": tspecs,
        "digests": {name: BLOCKSUM for name in carriers},
    }
    nbytes = sum((c.nbytes if isinstance(c, np.ndarray) else sum(a.nbytes for a in c)) for c in columns.values())
    return EncodedShard(header, index, columns, n, g, int(v.min()), int(v.max()), nbytes)
