"""Small HDF5 files without the HDF5 library: one root group of contiguous 1-D datasets plus scalar root attributes.

:func:`build_image` lays such a file out in memory in the oldest HDF5 format (superblock 0, version 1 object headers,
a symbol-table root group: what every HDF5 library reads), with the data after the metadata, each dataset aligned to
8 bytes. :func:`locate` finds the datasets and integer attributes of a file laid out like that and returns None for
any other file, so the caller falls back to the HDF5 library, which also names any damage. Nothing here is trusted
beyond the shard's own checksums: a reader verifies what it located.

The root group's names are kept in one B-tree node (level 0) whose children are symbol table nodes of up to
``2 * LEAF_K`` names each, the library's own layout for a group of that many members, so a file holds up to
``MAX_DATASETS`` datasets (the B-tree node's ``2 * INTERNAL_K`` children); a caller with more falls back to the
library.

The library costs ~0.1 ms per object created or opened; a text shard has ten of them, and a trainer step plans and
reads a few shards.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

UNDEF = 0xFFFFFFFFFFFFFFFF
SIGNATURE = b"\x89HDF\r\n\x1a\n"
LEAF_K = 4  # symbol table nodes hold up to 2 * LEAF_K names (the library's default)
INTERNAL_K = 16  # group B-tree nodes have room for 2 * INTERNAL_K children (the library's default)
SNOD_ENTRIES = 2 * LEAF_K
MAX_DATASETS = 2 * INTERNAL_K * SNOD_ENTRIES
_HEAP_FREE_NULL = 1  # "no free block" in a local heap
_SNOD_BYTES = 8 + 2 * LEAF_K * 40
_TREE_BYTES = 24 + 2 * INTERNAL_K * 8 + (2 * INTERNAL_K + 1) * 8
_FLOATS = {  # size: (sign bit, exponent location, exponent size, mantissa size, exponent bias)
    2: (15, 10, 5, 10, 15),
    4: (31, 23, 8, 23, 127),
    8: (63, 52, 11, 52, 1023),
}
_MSG_SPACE, _MSG_TYPE, _MSG_LAYOUT, _MSG_ATTR, _MSG_STAB = 0x01, 0x03, 0x08, 0x0C, 0x11


def _pad8(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 8)


def _message(mtype: int, body: bytes, flags: int = 0) -> bytes:
    body = _pad8(body)
    return struct.pack("<HHB3x", mtype, len(body), flags) + body


def _object_header(messages: list[bytes]) -> bytes:
    body = b"".join(messages)
    return struct.pack("<BBHII4x", 1, 0, len(messages), 1, len(body)) + body


def _datatype(dtype: np.dtype) -> bytes:
    if dtype.str[0] == ">" or dtype.kind not in "iuf" or (dtype.kind == "f" and dtype.itemsize not in _FLOATS):
        raise ValueError(f"cannot store dtype {dtype} (little-endian integers and IEEE floats only)")
    n = dtype.itemsize
    if dtype.kind == "f":
        sign, eloc, esize, msize, bias = _FLOATS[n]
        return struct.pack("<BBBBIHHBBBBI", 0x11, 0x20, sign, 0, n, 0, 8 * n, eloc, esize, 0, msize, bias)
    return struct.pack("<BBBBIHH", 0x10, 0x08 if dtype.kind == "i" else 0, 0, 0, n, 0, 8 * n)


def _dataspace(length: int | None) -> bytes:
    """A 1-D dataspace of ``length`` elements (fixed size), or a scalar one for None."""
    if length is None:
        return struct.pack("<BBBB4x", 1, 0, 0, 0)
    return struct.pack("<BBBB4xQQ", 1, 1, 1, 0, length, length)


def _attribute(name: str, value: int | bytes) -> bytes:
    if isinstance(value, int):
        dtype, data = _datatype(np.dtype(np.int64)), struct.pack("<q", value)
    else:  # fixed-length, null-padded ASCII string
        dtype, data = struct.pack("<BBBBI", 0x13, 0x01, 0, 0, len(value)), value
    space = _dataspace(None)
    nm = name.encode() + b"\0"
    head = struct.pack("<BBHHH", 1, 0, len(nm), len(dtype), len(space))
    return _message(_MSG_ATTR, head + _pad8(nm) + _pad8(dtype) + _pad8(space) + data)


def build_image(datasets: dict[str, np.ndarray], attrs: dict[str, int | bytes]) -> bytearray:
    """The bytes of an HDF5 file with these contiguous 1-D datasets (names without ``/``, 1 to ``MAX_DATASETS``)
    and scalar int64 / fixed-length string attributes on the root group."""
    names = sorted(datasets, key=str.encode)
    if not 0 < len(names) <= MAX_DATASETS or any("/" in n or not n for n in names):
        raise ValueError(f"cannot lay out datasets {names}")
    chunks = [names[i : i + SNOD_ENTRIES] for i in range(0, len(names), SNOD_ENTRIES)]  # one symbol table node each
    heap_data, name_offset = bytearray(8), {}  # offset 0: the empty name
    for n in names:
        name_offset[n] = len(heap_data)
        heap_data += _pad8(n.encode() + b"\0")
    attributes = [_attribute(k, v) for k, v in attrs.items()]
    root_bytes = 16 + 24 + sum(len(a) for a in attributes)
    headers = {}
    for n in names:
        arr = datasets[n]
        if arr.ndim != 1:
            raise ValueError(f"dataset {n} must be 1-D, got shape {arr.shape}")
        msgs = [_message(_MSG_SPACE, _dataspace(arr.shape[0])), _message(_MSG_TYPE, _datatype(arr.dtype), 1)]
        headers[n] = msgs
    # addresses: superblock, root header, heap header + data, B-tree node, symbol table node, dataset headers, data
    root_at = 96
    heap_at = root_at + root_bytes
    tree_at = heap_at + 32 + len(heap_data)
    snod_at = tree_at + _TREE_BYTES
    at = snod_at + len(chunks) * _SNOD_BYTES
    header_at = {}
    for n in names:
        header_at[n] = at
        at += 16 + sum(len(m) for m in headers[n]) + 32  # + the layout message
    data_at = {}
    for n in datasets:  # data in the caller's order
        at += -at % 8
        data_at[n] = at if datasets[n].nbytes else UNDEF
        at += datasets[n].nbytes
    eof = at
    root = _object_header([_message(_MSG_STAB, struct.pack("<QQ", tree_at, heap_at)), *attributes])
    out = bytearray(eof)
    out[0:96] = SIGNATURE + struct.pack(
        "<8BHHIQQQQQQIIQQ", 0, 0, 0, 0, 0, 8, 8, 0, LEAF_K, INTERNAL_K, 0, 0, UNDEF, eof, UNDEF,
        0, root_at, 1, 0, tree_at, heap_at,
    )
    out[root_at:heap_at] = root
    out[heap_at : heap_at + 32] = struct.pack("<4sB3xQQQ", b"HEAP", 0, len(heap_data), _HEAP_FREE_NULL, heap_at + 32)
    out[heap_at + 32 : tree_at] = heap_data
    # keys around the children: the empty name, then the last (largest) name of each child
    tree = struct.pack("<4sBBHQQQ", b"TREE", 0, 0, len(chunks), UNDEF, UNDEF, 0)
    for i, chunk in enumerate(chunks):
        tree += struct.pack("<QQ", snod_at + i * _SNOD_BYTES, name_offset[chunk[-1]])
    out[tree_at : tree_at + len(tree)] = tree
    for i, chunk in enumerate(chunks):
        snod = struct.pack("<4sBBH", b"SNOD", 1, 0, len(chunk))
        snod += b"".join(struct.pack("<QQII16x", name_offset[n], header_at[n], 0, 0) for n in chunk)
        at = snod_at + i * _SNOD_BYTES
        out[at : at + len(snod)] = snod
    for n in names:
        arr = datasets[n]
        layout = _message(_MSG_LAYOUT, struct.pack("<BBQQ", 3, 1, data_at[n], arr.nbytes))
        h = _object_header([*headers[n], layout])
        out[header_at[n] : header_at[n] + len(h)] = h
        if arr.nbytes:
            out[data_at[n] : data_at[n] + arr.nbytes] = np.ascontiguousarray(arr).view(np.uint8).data
    return out


# --------------------------------------------------------------------------------------------------------- reading
class _Unknown(Exception):
    """Not laid out as :func:`build_image` lays files out."""


_SUPER = struct.Struct("<8s8BHHIQQQQQQIIQQ")
_ROOT = struct.Struct("<BBHII4xHHB3xQQ")  # object header prefix, then its symbol table message
_DATASET = struct.Struct("<BBHII4xHHB3xBB6xQQ")  # object header prefix, then its dataspace message
_MESSAGE = struct.Struct("<HHB3x")
_LAYOUT = struct.Struct("<HHB3xBBQQ")
_HEAP = struct.Struct("<4sB3xQQQ")
_NODE = struct.Struct("<4sBBH")
_ENTRY = struct.Struct("<QQ")
_ATTRIBUTE = struct.Struct("<BBHHH")
_INT64 = struct.Struct("<q")
#: Datatype message bodies (without padding) of the dtypes :func:`build_image` writes.
_DTYPES = {_datatype(np.dtype(f"<{k}{n}")): np.dtype(f"<{k}{n}") for k in "iu" for n in (1, 2, 4, 8)}
_DTYPES.update({_datatype(np.dtype(f"<f{n}")): np.dtype(f"<f{n}") for n in _FLOATS})


def locate(buf: Any) -> tuple[dict[str, tuple[int, int, np.dtype]], dict[str, int]] | None:
    """The datasets (offset, length, dtype) and scalar int64 attributes of the root group of the HDF5 file ``buf``
    laid out as :func:`build_image` lays files out, or None for any other file (the HDF5 library reads those)."""
    try:
        return _locate(buf)
    except (_Unknown, struct.error, IndexError, UnicodeDecodeError):
        return None


def _locate(buf: Any) -> tuple[dict[str, tuple[int, int, np.dtype]], dict[str, int]]:
    sb = _SUPER.unpack_from(buf, 0)
    if sb[:11] != (SIGNATURE, 0, 0, 0, 0, 0, 8, 8, 0, LEAF_K, INTERNAL_K) or sb[12] != 0 or sb[14] != len(buf):
        raise _Unknown
    root_at = sb[17]
    version, _, count, _, size, mtype, _, _, tree_at, heap_at = _ROOT.unpack_from(buf, root_at)
    if version != 1 or mtype != _MSG_STAB:
        raise _Unknown
    attrs: dict[str, int] = {}
    pos, end = root_at + 40, root_at + 16 + size
    for _ in range(count - 1):
        mtype, msize, _ = _MESSAGE.unpack_from(buf, pos)
        if pos + 8 + msize > end:
            raise _Unknown
        if mtype == _MSG_ATTR and (found := _int_attribute(buf, pos + 8)) is not None:
            attrs[found[0]] = found[1]
        pos += 8 + msize
    sig, version, heap_size, _, heap_data = _HEAP.unpack_from(buf, heap_at)
    sig_tree, node_type, level, used = _NODE.unpack_from(buf, tree_at)
    if (sig, version, sig_tree, node_type, level) != (b"HEAP", 0, b"TREE", 0, 0) or not 0 < used <= 2 * INTERNAL_K:
        raise _Unknown
    heap_end = heap_data + heap_size
    datasets: dict[str, tuple[int, int, np.dtype]] = {}
    for child in range(used):
        snod_at = _ENTRY.unpack_from(buf, tree_at + 24 + 16 * child)[1]
        sig, version, _, count = _NODE.unpack_from(buf, snod_at)
        if sig != b"SNOD" or version != 1 or count > SNOD_ENTRIES:
            raise _Unknown
        for i in range(count):
            name_at, header_at = _ENTRY.unpack_from(buf, snod_at + 8 + 40 * i)
            name_at += heap_data
            name_end = buf.find(b"\0", name_at, heap_end) if name_at < heap_end else -1
            if name_end < 0:
                raise _Unknown
            datasets[bytes(buf[name_at:name_end]).decode()] = _dataset(buf, header_at)
    return datasets, attrs


def _dataset(buf: Any, at: int) -> tuple[int, int, np.dtype]:
    """(data offset, length, dtype) of a dataset's object header: dataspace, datatype and layout messages."""
    version, _, count, _, size, mtype, msize, _, sversion, rank, length, _ = _DATASET.unpack_from(buf, at)
    if (version, count, mtype, sversion, rank) != (1, 3, _MSG_SPACE, 1, 1):
        raise _Unknown
    pos = at + 24 + msize
    mtype, msize, _ = _MESSAGE.unpack_from(buf, pos)
    dtype = _DTYPES.get(bytes(buf[pos + 8 : pos + (20 if msize == 16 else 28)]))
    if mtype != _MSG_TYPE or dtype is None:
        raise _Unknown
    pos += 8 + msize
    mtype, _, _, version, layout, addr, nbytes = _LAYOUT.unpack_from(buf, pos)
    if mtype != _MSG_LAYOUT or (version, layout) != (3, 1) or pos + 32 != at + 16 + size:
        raise _Unknown
    if nbytes != length * dtype.itemsize or (nbytes and addr + nbytes > len(buf)):
        raise _Unknown
    return addr, length, dtype


def _int_attribute(buf: Any, pos: int) -> tuple[str, int] | None:
    """(name, value) of a scalar int64 attribute message body; None for other attributes."""
    version, _, nsize, tsize, ssize = _ATTRIBUTE.unpack_from(buf, pos)
    if version != 1:
        raise _Unknown
    type_at = pos + 8 + nsize + (-nsize % 8)
    space_at = type_at + tsize + (-tsize % 8)
    if _DTYPES.get(bytes(buf[type_at : type_at + tsize])) != np.int64 or buf[space_at + 1] != 0:  # int64, scalar
        return None
    name = bytes(buf[pos + 8 : pos + 8 + nsize]).rstrip(b"\0").decode("ascii", "replace")
    return name, _INT64.unpack_from(buf, space_at + ssize + (-ssize % 8))[0]
