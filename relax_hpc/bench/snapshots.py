"""Weight-snapshot throughput against the raw bandwidth of the same folder.

``python -m relax_hpc.bench.snapshots [--dir DIR] [--gb 1.0] [--repeat 3] [--json]``; with ``--delta``: delta
snapshots vs full ones on consecutive versions of real training runs (:mod:`relax_hpc.bench.delta`).

A state dict shaped like a small LLM (bf16 matrices, fp32 norms) is published with :class:`SnapshotPublisher` and
loaded with :class:`SnapshotReader` inside a temporary run dir under ``DIR``. "Raw" is the same number of bytes written
from the same tensors' memory into one plain file with sequential ``write`` calls and one ``fsync`` before the clock
stops, then read back with sequential ``readinto`` calls into a preallocated buffer (no parsing, no hashing). Both
sides get the same page-cache treatment: every file is fsynced and dropped from the page cache
(``posix_fadvise(DONTNEED)``) before it is read, so reads are cold. Rates are medians over ``--repeat`` rounds; ratios
are medians of each round's ratio (raw and snapshot run back to back, in alternating order). Retention after a
publish runs in the background, as in training, and is finished before the next measurement starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from relax_hpc.bench.common import model_like_state_dict

CHUNK = 16 << 20


def drop_cache(path: Path) -> None:
    """fsync a file and drop its pages from this node's page cache, so the next read comes from storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_write(path: Path, state_dict: dict[str, Any]) -> float:
    """Seconds to write every tensor's bytes sequentially into one file and fsync it."""
    from relax_hpc.weights.format import tensor_bytes

    t0 = time.perf_counter()
    with open(path, "wb", buffering=4 << 20) as f:
        for t in state_dict.values():
            f.write(tensor_bytes(t))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def raw_read(path: Path) -> float:
    """Seconds to read a file sequentially into a preallocated buffer."""
    import numpy as np

    size = path.stat().st_size
    buf = np.empty(size, dtype=np.uint8)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        off = 0
        while off < size:
            n = f.readinto(view[off:off + CHUNK])
            if not n:
                break
            off += n
    return time.perf_counter() - t0


def run(folder: Path, gb: float, repeat: int, device: str = "cpu", max_file_mb: int = 512) -> dict[str, Any]:
    """Measure everything in a fresh temporary folder under ``folder``; returns the figures."""
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights import SnapshotPublisher, SnapshotReader
    from relax_hpc.weights.format import tensor_nbytes

    sd = model_like_state_dict(gb)
    nbytes = sum(tensor_nbytes(t) for t in sd.values())
    work = Path(tempfile.mkdtemp(prefix=".relax-bench-snapshots-", dir=folder))
    times: dict[str, list[float]] = {k: [] for k in ("raw_write", "raw_read", "raw_reread", "publish", "load",
                                                         "load_size")}
    try:
        rd = RunDir.create(work / "run")
        pub = SnapshotPublisher(rd, keep_last=1, max_file_bytes=max_file_mb << 20)
        reader = SnapshotReader(rd, name="bench")
        raw = work / "raw.bin"
        for i in range(repeat):
            # Alternate which side goes first, so drift in the storage's speed does not favour either.
            for side in ("raw", "snapshot") if i % 2 == 0 else ("snapshot", "raw"):
                if side == "raw":
                    times["raw_write"].append(raw_write(raw, sd))
                    for key in ("raw_read", "raw_reread"):  # as the two loads below: first and second read
                        drop_cache(raw)
                        times[key].append(raw_read(raw))
                    raw.unlink()
                    continue
                t0 = time.perf_counter()
                snap = pub.publish(sd, version=i + 1, step=i)
                times["publish"].append(time.perf_counter() - t0)
                pub.wait_housekeeping()  # retention runs beside the caller; keep it out of the next measurement
                for level, key in (("sha256", "load"), ("size", "load_size")):
                    for f in snap.glob("*.safetensors"):
                        drop_cache(f)
                    t0 = time.perf_counter()
                    loaded = reader.load(i + 1, device=device, verify=level)  # type: ignore[arg-type]
                    times[key].append(time.perf_counter() - t0)
                    del loaded
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rate = {k: nbytes / 1e9 / statistics.median(v) for k, v in times.items()}

    def ratio(ours: str, raw_key: str) -> float:  # median of per-round ratios: each round's pair ran back to back
        return round(statistics.median(r / o for o, r in zip(times[ours], times[raw_key], strict=True)), 3)

    return {
        "gb": round(nbytes / 1e9, 3), "tensors": len(sd), "repeat": repeat, "dir": str(folder), "device": device,
        "max_file_mb": max_file_mb,
        "raw_write_gb_per_s": round(rate["raw_write"], 3), "raw_read_gb_per_s": round(rate["raw_read"], 3),
        "publish_gb_per_s": round(rate["publish"], 3), "load_gb_per_s": round(rate["load"], 3),
        "load_size_only_gb_per_s": round(rate["load_size"], 3),
        "publish_ratio": ratio("publish", "raw_write"), "load_ratio": ratio("load", "raw_read"),
        "raw_reread_gb_per_s": round(rate["raw_reread"], 3), "load_size_only_ratio": ratio("load_size", "raw_reread"),
        "raw": "same bytes, one plain file: sequential write + fsync; cold sequential readinto (no parse, no hash)",
        "cache": "every file fsynced and dropped from the page cache (posix_fadvise DONTNEED) before it is read",
        "verify": "load_gb_per_s checks sizes + full sha256 (first cold read after the write, vs raw_read); "
                  "load_size_only_gb_per_s checks sizes only (second cold read, vs raw_reread)",
    }


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; prints a table or, with ``--json``, one JSON object. ``--delta``: delta snapshots
    vs full ones instead (:mod:`relax_hpc.bench.delta`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--delta" in argv:
        from relax_hpc.bench import delta

        return delta.main([a for a in argv if a != "--delta"])
    ap = argparse.ArgumentParser(prog="python -m relax_hpc.bench.snapshots", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("."), help="folder to measure (a temporary subfolder is used)")
    ap.add_argument("--gb", type=float, default=1.0, help="size of the state dict in GB (default 1.0)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; each figure is the median (default 3)")
    ap.add_argument("--device", default="cpu", help="where loaded tensors go (cpu, cuda); raw reads stay in memory")
    ap.add_argument("--max-file-mb", type=int, default=512, help="snapshot file size limit (default 512)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if not args.dir.is_dir():
        ap.error(f"--dir {args.dir} is not a folder")
    if args.gb <= 0 or args.repeat < 1:
        ap.error("--gb must be positive and --repeat at least 1")
    res = run(args.dir.absolute(), args.gb, args.repeat, args.device, args.max_file_mb)
    if args.json:
        print(json.dumps(res))
        return 0
    for k, v in res.items():
        print(f"{k:>24}  {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
