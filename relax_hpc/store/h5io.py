"""The few HDF5 operations the store needs, on h5py's low-level API (4x less overhead per call than ``f[name]``).

Files are never locked (HDF5's flock breaks on Lustre without ``-o flock`` and on NFS). Datasets are 1-D,
contiguous, unfiltered: a hyperslab read goes straight into the caller's buffer.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")  # for HDF5 builds without H5Pset_file_locking


#: Property lists and type ids made once per process (each costs HDF5 calls per use otherwise).
_CACHE: dict[str, Any] = {}
_TYPES: dict[np.dtype, Any] = {}


def _fapl() -> Any:
    fapl = _CACHE.get("fapl")
    if fapl is None:
        from h5py import h5p

        fapl = h5p.create(h5p.FILE_ACCESS)
        with contextlib.suppress(AttributeError, RuntimeError):  # old HDF5: the environment variable above does it
            fapl.set_file_locking(False, True)
        _CACHE["fapl"] = fapl
    return fapl


def _lcpl() -> Any:
    lcpl = _CACHE.get("lcpl")
    if lcpl is None:
        from h5py import h5p

        lcpl = h5p.create(h5p.LINK_CREATE)
        lcpl.set_create_intermediate_group(True)
        _CACHE["lcpl"] = lcpl
    return lcpl


def _type_id(dtype: np.dtype) -> Any:
    tid = _TYPES.get(dtype)
    if tid is None:
        from h5py import h5t

        tid = _TYPES[dtype] = h5t.py_create(dtype)
    return tid


def create_file(path: Path) -> Any:
    """Create (truncate) ``path``; returns a FileID to :func:`close`."""
    from h5py import h5f

    return h5f.create(os.fsencode(path), h5f.ACC_TRUNC, fapl=_fapl())


def open_file(path: Path) -> Any:
    """Open ``path`` read-only; returns a FileID to :func:`close`."""
    from h5py import h5f

    return h5f.open(os.fsencode(path), h5f.ACC_RDONLY, fapl=_fapl())


def close(fid: Any) -> None:
    fid.close()


def abandon(fid: Any) -> None:
    """Close a file whose write failed (full disk, I/O error) without touching the disk again.

    HDF5 cannot close a file it cannot flush, and would retry (and fail) when the id is garbage collected. Its
    descriptor is pointed at an anonymous in-memory file first, so the close succeeds and the space of the
    (deleted) temporary file is released.
    """
    with contextlib.suppress(Exception):
        fd = fid.get_vfd_handle()
        mem = os.memfd_create("relax-hpc-abandoned-shard") if hasattr(os, "memfd_create") else os.open(os.devnull, 1)
        os.dup2(mem, fd)
        os.close(mem)
    with contextlib.suppress(Exception):
        fid.close()


def create_dataset(fid: Any, name: str, dtype: np.dtype, length: int) -> Any:
    """A contiguous 1-D dataset (``a/b`` creates group ``a``)."""
    from h5py import h5d, h5s

    lcpl = _lcpl() if "/" in name else None
    return h5d.create(fid, name.encode(), _type_id(np.dtype(dtype)), h5s.create_simple((length,)), lcpl=lcpl)


def write_slice(ds: Any, lo: int, data: np.ndarray) -> None:
    """Write the contiguous 1-D ``data`` at elements ``[lo, lo + data.size)``."""
    from h5py import h5s

    if data.size:
        fspace = ds.get_space()
        fspace.select_hyperslab((lo,), (data.size,))
        ds.write(h5s.create_simple((data.size,)), fspace, data)


def write_dataset(fid: Any, name: str, data: np.ndarray) -> None:
    """Create a dataset holding the contiguous 1-D ``data``."""
    ds = create_dataset(fid, name, data.dtype, data.size)
    if data.size:
        from h5py import h5s

        ds.write(h5s.ALL, h5s.ALL, data)


def open_dataset(fid: Any, name: str) -> Any:
    from h5py import h5d

    return h5d.open(fid, name.encode())


def open_vector(fid: Any, name: str) -> tuple[Any, tuple[int, ...], np.dtype]:
    """Open a dataset: (dataset id, shape, dtype)."""
    from h5py import h5d

    ds = h5d.open(fid, name.encode())
    return ds, ds.get_space().get_simple_extent_dims(), ds.dtype


def read_whole(ds: Any, out: np.ndarray) -> None:
    """Read a whole dataset into ``out`` of its shape and dtype (one HDF5 call, no dataspace objects)."""
    if out.size:
        from h5py import h5s

        ds.read(h5s.ALL, h5s.ALL, out, _type_id(out.dtype))


def read_into(ds: Any, lo: int, out: np.ndarray) -> None:
    """Read elements ``[lo, lo + out.size)`` of a 1-D dataset into the contiguous ``out`` (one HDF5 call)."""
    from h5py import h5s

    if out.size:
        fspace = ds.get_space()
        fspace.select_hyperslab((lo,), (out.size,))
        ds.read(h5s.create_simple((out.size,)), fspace, out)


def write_attr(fid: Any, name: str, value: int | str) -> None:
    """A scalar int64 or fixed-length string attribute on the root group."""
    from h5py import h5a, h5s, h5t

    data = np.array(value, np.int64) if isinstance(value, int) else np.array(value.encode(), dtype="S")
    tid = _type_id(data.dtype) if data.dtype == np.int64 else h5t.py_create(data.dtype)
    attr = h5a.create(fid, name.encode(), tid, h5s.create(h5s.SCALAR))
    attr.write(data)


def read_int_attr(fid: Any, name: str) -> int:
    from h5py import h5a

    attr = h5a.open(fid, name.encode())
    out = np.empty((), np.int64)
    attr.read(out)
    return int(out)
