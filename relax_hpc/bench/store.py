"""Sample-store throughput: text samples/s and large multimodal MB/s, beside the raw bandwidth of the same folder.

``python -m relax_hpc.bench.store [--json] [--dir DIR]``

* text: ~1k-token samples (prompt + response ids, logprobs, loss mask, reward, metadata) written through
  :class:`ShardWriter` in shards of ``--text-shard`` samples and read back through a :class:`ConsumerGroup` plan.
* large: samples carrying ~4 MB of ``pixel_values`` each, written and read the same way, in MB/s of sample bytes.
* raw: the same number of bytes in files of the same sizes, in the same folder, written the way the store writes
  (temporary file, write, fsync, rename) and read with plain sequential ``readinto`` calls.

Every read, store or raw, starts with the files' page cache dropped (``posix_fadvise(DONTNEED)`` after the fsync),
so reads come from the device, not memory. Each figure is the best of ``--repeat`` rounds; the store and raw rounds
alternate so drifts of a shared machine hit both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.rundir import RunDir
from relax_hpc.store import ConsumerGroup, Sample, SampleGroup, ShardWriter


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _drop_folder(folder: Path) -> None:
    for p in folder.rglob("*.h5"):
        _drop_cache(p)


def text_groups(num_samples: int, group_size: int, rng: np.random.Generator) -> list[SampleGroup]:
    """Groups of ~1k-token samples (prompt ~256, response ~768 tokens, ragged)."""
    groups = []
    for g in range(num_samples // group_size):
        plen = int(rng.integers(192, 320))
        prompt = rng.integers(0, 150_000, plen, dtype=np.int32)
        samples = []
        for i in range(group_size):
            rlen = int(rng.integers(512, 1024))
            samples.append(
                Sample(
                    prompt_ids=prompt,
                    response_ids=rng.integers(0, 150_000, rlen, dtype=np.int32),
                    logprobs=-rng.random(rlen, dtype=np.float32),
                    reward=float(rng.random()),
                    loss_mask=np.ones(rlen, np.uint8),
                    version=3,
                    timings={"generate": 1.5},
                    metadata={"uid": f"t{g}-{i}"},
                )
            )
        groups.append(SampleGroup(f"t{g}", samples))
    return groups


def large_groups(num_samples: int, group_size: int, mb: float, rng: np.random.Generator) -> list[SampleGroup]:
    """Groups of samples carrying ``mb`` MB of float32 pixel_values each (plus an image_grid_thw)."""
    rows = max(1, int(mb * 1e6 / (1176 * 4)))
    groups = []
    for g in range(num_samples // group_size):
        samples = []
        for i in range(group_size):
            pix = rng.standard_normal((rows, 1176), dtype=np.float32)
            samples.append(
                Sample(
                    prompt_ids=rng.integers(0, 150_000, 300, dtype=np.int32),
                    response_ids=rng.integers(0, 150_000, 200, dtype=np.int32),
                    logprobs=-rng.random(200, dtype=np.float32),
                    reward=1.0,
                    version=3,
                    metadata={"uid": f"l{g}-{i}"},
                    tensors={"pixel_values": pix, "image_grid_thw": np.array([[1, rows // 2, 2]], np.int64)},
                )
            )
        groups.append(SampleGroup(f"l{g}", samples))
    return groups


def _write_store(root: Path, shards: list[list[SampleGroup]], background: bool) -> tuple[float, int, RunDir]:
    if root.exists():
        shutil.rmtree(root)
    rd = RunDir.create(root)
    nbytes = 0
    t0 = time.perf_counter()
    with ShardWriter(rd, "bench.0", background=background) as writer:
        for groups in shards:
            nbytes += writer.write(groups).nbytes
    return time.perf_counter() - t0, nbytes, rd


def _read_store(rd: RunDir, total: int, per_step: int) -> tuple[float, int]:
    _drop_folder(rd.shards)
    consumer = ConsumerGroup(rd, retention="keep")
    n = 0
    t0 = time.perf_counter()
    step = 0
    while n < total:
        step += 1
        plan = consumer.plan(step, min(per_step, total - n), timeout_s=5)
        n += len(consumer.read(plan))
    return time.perf_counter() - t0, n


def _raw_write(folder: Path, sizes: list[int]) -> float:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    blob = np.random.default_rng(1).integers(0, 255, max(sizes), dtype=np.uint8)
    t0 = time.perf_counter()
    for i, size in enumerate(sizes):
        tmp, final = folder / f".tmp-{i}", folder / f"{i:06d}.bin"
        with open(tmp, "wb") as f:
            f.write(memoryview(blob)[:size])
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
    return time.perf_counter() - t0


def _raw_read(folder: Path) -> float:
    files = sorted(folder.glob("*.bin"))
    for p in files:
        _drop_cache(p)
    t0 = time.perf_counter()
    for p in files:
        buf = np.empty(p.stat().st_size, np.uint8)
        with open(p, "rb", buffering=0) as f:
            f.readinto(memoryview(buf))
    return time.perf_counter() - t0


def run(base: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run every measurement under ``base`` and return the figures."""
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"dir": str(base)}
    # ---- text
    groups = text_groups(args.text_samples, 8, rng)
    per = args.text_shard // 8
    shards = [groups[i : i + per] for i in range(0, len(groups), per)]
    n_text = sum(len(g.samples) for g in groups)
    best_w = best_wb = best_r = float("inf")
    for _ in range(args.repeat):
        dt, nbytes, rd = _write_store(base / "text", shards, background=False)
        best_w = min(best_w, dt)
        dt, n = _read_store(rd, n_text, args.text_shard * 4)
        assert n == n_text, (n, n_text)
        best_r = min(best_r, dt)
        dt, _, _ = _write_store(base / "text", shards, background=True)
        best_wb = min(best_wb, dt)
    out.update(
        text_samples=n_text,
        text_shard_samples=args.text_shard,
        text_mb=round(nbytes / 1e6, 1),
        text_write_samples_per_s=round(n_text / best_w),
        text_write_background_samples_per_s=round(n_text / best_wb),
        text_read_samples_per_s=round(n_text / best_r),
    )
    shutil.rmtree(base / "text", ignore_errors=True)
    # ---- large multimodal
    groups = large_groups(args.large_samples, 4, args.large_mb, rng)
    per = args.large_shard // 4
    shards = [groups[i : i + per] for i in range(0, len(groups), per)]
    n_large = sum(len(g.samples) for g in groups)
    bw = br = rw = rr = float("inf")
    sizes: list[int] = []
    for _ in range(args.repeat):
        dt, nbytes, rd = _write_store(base / "large", shards, background=False)
        bw = min(bw, dt)
        sizes = [p.stat().st_size for p in sorted(rd.shards.rglob("*.h5"))]
        rw = min(rw, _raw_write(base / "raw", sizes))
        dt, n = _read_store(rd, n_large, args.large_shard)
        assert n == n_large, (n, n_large)
        br = min(br, dt)
        rr = min(rr, _raw_read(base / "raw"))
    raw_bytes = sum(sizes)
    out.update(
        large_samples=n_large,
        large_sample_mb=round(nbytes / n_large / 1e6, 2),
        large_shard_samples=args.large_shard,
        large_mb=round(nbytes / 1e6, 1),
        large_write_mb_per_s=round(nbytes / bw / 1e6, 1),
        large_read_mb_per_s=round(nbytes / br / 1e6, 1),
        raw_write_mb_per_s=round(raw_bytes / rw / 1e6, 1),
        raw_read_mb_per_s=round(raw_bytes / rr / 1e6, 1),
    )
    out["large_write_ratio"] = round(out["large_write_mb_per_s"] / out["raw_write_mb_per_s"], 3)
    out["large_read_ratio"] = round(out["large_read_mb_per_s"] / out["raw_read_mb_per_s"], 3)
    out["raw_means"] = (
        "same bytes in files of the same sizes, same folder; written tmp+write+fsync+rename, "
        "read with sequential readinto; page cache of every file dropped (posix_fadvise DONTNEED) before reads"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; prints the figures (JSON with ``--json``)."""
    ap = argparse.ArgumentParser(prog="python -m relax_hpc.bench.store", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--dir", type=Path, default=None, help="folder to measure in (default: a temp folder in .)")
    ap.add_argument("--text-samples", type=int, default=16384)
    ap.add_argument("--text-shard", type=int, default=256, help="samples per text shard")
    ap.add_argument("--large-samples", type=int, default=96)
    ap.add_argument("--large-shard", type=int, default=16, help="samples per large shard")
    ap.add_argument("--large-mb", type=float, default=4.0, help="MB of pixel_values per large sample")
    ap.add_argument("--repeat", type=int, default=2, help="rounds; the best of each figure is kept")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    args = ap.parse_args(argv)
    parent = args.dir or Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix=".bench-store-", dir=parent))
    try:
        res = run(base, args)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:28s} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
