"""Sample-store throughput: text samples/s and large multimodal MB/s, beside the raw bandwidth of the same folder.

``python -m relax_hpc.bench.store [--json] [--dir DIR]``

* text: ~1k-token samples (prompt + response ids, logprobs, loss mask, reward, metadata) written through
  :class:`ShardWriter` in shards of ``--text-shard`` samples and read back through a :class:`ConsumerGroup` plan.
* large: samples carrying ~4 MB of ``pixel_values`` each, written and read the same way, in MB/s of sample bytes.
* fast path: per-shard milliseconds of writing (fsync included) and of planning + reading one text shard of the demo's
  shape (16 prompts x 8 samples, ~20 tokens) and of a real one (64 x 8, ~1k tokens), with the in-memory layout of
  :mod:`relax_hpc.store.h5raw` and with the HDF5 library only (the baseline, same run, rounds alternating).
* raw: the same number of bytes in files of the same sizes, in the same folder, written the way the store writes
  (temporary file, write, fsync, rename) and read with plain sequential ``readinto`` calls.

Every read, store or raw, starts with the files' page cache dropped (``posix_fadvise(DONTNEED)`` after the fsync),
so reads come from the device, not memory. Each figure is the best of ``--repeat`` rounds; the store and raw rounds
alternate so drifts of a shared machine hit both alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.rundir import RunDir
from relax_hpc.store import ConsumerGroup, Sample, SampleGroup, ShardWriter, backlog
from relax_hpc.store.watch import samples_watch


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


@contextlib.contextmanager
def _library_only(on: bool) -> Iterator[None]:
    """Within the block (if ``on``), shards are written and read by the HDF5 library only (no h5raw layout)."""
    from relax_hpc.store import consumer, shard

    saved = shard.IMAGE_BYTES, consumer.load_small
    if on:
        shard.IMAGE_BYTES, consumer.load_small = -1, lambda *a, **k: None
    try:
        yield
    finally:
        shard.IMAGE_BYTES, consumer.load_small = saved


def _shard_ms(root: Path, batches: list[list[SampleGroup]], library: bool) -> tuple[float, float]:
    """(write, plan + read) milliseconds per shard, one shard per batch."""
    shutil.rmtree(root, ignore_errors=True)
    rd = RunDir.create(root)
    with _library_only(library):
        writer = ShardWriter(rd, "rollout-0.a")
        reader = ConsumerGroup(rd, data_cache_bytes=0 if library else 64 << 20)
        tw = tr = 0.0
        for k, groups in enumerate(batches):
            t0 = time.perf_counter()
            writer.write(groups)
            t1 = time.perf_counter()
            got = reader.read(reader.plan(k + 1, num_groups=len(groups), timeout_s=60))
            tr += time.perf_counter() - t1
            tw += t1 - t0
            assert len(got) == sum(len(g.samples) for g in groups)
    shutil.rmtree(root, ignore_errors=True)
    return tw / len(batches) * 1e3, tr / len(batches) * 1e3


def fast_path(base: Path, rounds: int, repeat: int) -> dict[str, Any]:
    """The h5raw fast path against the library at the demo's and a real shard shape (module docstring)."""
    rng = np.random.default_rng(1)
    out: dict[str, Any] = {}
    for name, prompts, plen, rlen, n in (("demo", 16, 12, 8, rounds), ("real", 64, 256, 768, max(2, rounds // 5))):
        batches = []
        for _ in range(n):
            groups = []
            for g in range(prompts):
                p = rng.integers(0, 150_000, plen, dtype=np.int32)
                groups.append(SampleGroup(f"g{g}", [Sample(
                    prompt_ids=p, response_ids=rng.integers(0, 150_000, rlen, dtype=np.int32),
                    logprobs=-rng.random(rlen, dtype=np.float32), reward=float(rng.random()), version=0,
                    metadata={"finish_reason": "stop"}) for _ in range(8)]))
            batches.append(groups)
        best = {False: (float("inf"),) * 2, True: (float("inf"),) * 2}
        for _ in range(repeat):
            for library in (False, True):
                w, r = _shard_ms(base / "fastpath", batches, library)
                best[library] = (min(best[library][0], w), min(best[library][1], r))
        (fw, fr), (lw, lr) = best[False], best[True]
        out.update({f"fastpath_{name}_write_ms": round(fw, 2), f"fastpath_{name}_read_ms": round(fr, 2),
                    f"library_{name}_write_ms": round(lw, 2), f"library_{name}_read_ms": round(lr, 2),
                    f"fastpath_{name}_saved_ms_per_shard": round(lw + lr - fw - fr, 2)})
    return out


def run(base: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run every measurement under ``base`` and return the figures."""
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"dir": str(base)}
    out.update(fast_path(base, args.fastpath_rounds, max(3, args.repeat)))
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


def small_group(gid: str, group_size: int, rng: np.random.Generator) -> SampleGroup:
    """One GRPO group of short samples (prompt 64, response 64-128 tokens): what a writer publishes per prompt."""
    prompt = rng.integers(0, 150_000, 64, dtype=np.int32)
    samples = []
    for i in range(group_size):
        rlen = int(rng.integers(64, 128))
        samples.append(Sample(prompt_ids=prompt, response_ids=rng.integers(0, 150_000, rlen, dtype=np.int32),
                              logprobs=-rng.random(rlen, dtype=np.float32), reward=float(rng.random()),
                              version=1, metadata={"uid": f"{gid}/{i}"}))
    return SampleGroup(gid, samples)


def _count(folder: Path) -> tuple[int, int]:
    """(files, directory entries) under ``folder`` (entries: files + folders, as a metadata server counts)."""
    files = entries = 0
    for _, dirs, names in os.walk(folder):
        files += len(names)
        entries += len(names) + len(dirs)
    return files, entries


def simulate_writers(base: Path, writers: int, args: argparse.Namespace) -> dict[str, Any]:
    """``writers`` writer identities publish shards of ``--sim-shard-groups`` groups in random order at the rate the
    trainer consumes (a step's worth of shards between two steps, each from a random writer); the trainer plans,
    reads and (every ``--sim-commit-every`` steps) commits, which deletes consumed shards. Timed per step: the look
    of the fully-async trainer's wait (one poll of its change watch and one backlog), the plan and the read.
    Counted: files and entries created per step and alive at the end."""
    rng = np.random.default_rng(writers)
    rd = RunDir.create(base / f"writers-{writers}")
    ws = [ShardWriter(rd, f"rollout-{i}.sim{writers}") for i in range(writers)]
    per_step = args.sim_step_samples // args.sim_group_size  # groups per step
    shards_per_step = max(1, per_step // args.sim_shard_groups)
    consumer = ConsumerGroup(rd, retention="delete")
    plan_ms, read_ms, wait_ms, commit_ms, created, alive = [], [], [], [], [], []
    watch = samples_watch(rd)
    g = 0
    lead = 2  # steps of data published ahead of the trainer (a small backlog, as admission control keeps it)
    for step in range(1, args.sim_steps + lead + 1):
        before = _count(rd.samples)[0]
        for _ in range(shards_per_step):
            w = ws[int(rng.integers(writers))]
            w.write([small_group(f"g{g + j}", args.sim_group_size, rng) for j in range(args.sim_shard_groups)])
            g += args.sim_shard_groups
        if step <= lead:
            continue
        t = step - lead
        tw = time.perf_counter()
        watch.changed()
        backlog(rd)
        tb = time.perf_counter()
        t0 = time.perf_counter()
        plan = consumer.plan(t, per_step * args.sim_group_size, timeout_s=30)
        t1 = time.perf_counter()
        got = consumer.read(plan)
        t2 = time.perf_counter()
        assert len(got) == per_step * args.sim_group_size, (len(got), t)
        if t % args.sim_commit_every == 0:
            tc = time.perf_counter()
            consumer.commit(consumer.position_after(t))
            commit_ms.append((time.perf_counter() - tc) * 1e3)
        files, _ = _count(rd.samples)
        created.append(files - before)
        alive.append(files)
        if t > args.sim_warmup:
            plan_ms.append((t1 - t0) * 1e3)
            read_ms.append((t2 - t1) * 1e3)
            wait_ms.append((tb - tw) * 1e3)
    files, entries = _count(rd.root)
    shutil.rmtree(rd.root, ignore_errors=True)
    return {"writers": writers, "steps": len(plan_ms), "shards_per_step": shards_per_step,
            "samples_per_step": per_step * args.sim_group_size,
            "plan_ms_p50": round(float(np.median(plan_ms)), 2), "plan_ms_max": round(float(max(plan_ms)), 2),
            "read_ms_p50": round(float(np.median(read_ms)), 2),
            "watch_backlog_ms_p50": round(float(np.median(wait_ms)), 2),
            "commit_ms_p50": round(float(np.median(commit_ms)), 2),
            "plan_ms_per_shard": round(float(np.median(plan_ms)) / shards_per_step, 3),
            "files_alive_max": max(alive), "files_alive_end": alive[-1],
            "net_files_per_step": round((alive[-1] - alive[0]) / max(1, len(alive) - 1), 2),
            "run_dir_files_end": files, "run_dir_entries_end": entries,
            "plans_from_index": consumer.counters["index_plans"], "full_scans": consumer.counters["full_scans"]}


def main_writers(base: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The scale simulation for each ``--writers`` count, and the growth of planning cost between them."""
    rows = [simulate_writers(base, n, args) for n in args.writers]
    out: dict[str, Any] = {"dir": str(base), "runs": rows}
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        out["plan_growth"] = round(last["plan_ms_p50"] / max(first["plan_ms_p50"], 1e-6), 2)
        out["writer_growth"] = round(last["writers"] / first["writers"], 2)
    out["plan_target_ms"] = 50.0
    out["plan_ok"] = all(r["plan_ms_p50"] <= 50.0 for r in rows)
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
    ap.add_argument("--fastpath-rounds", type=int, default=60, help="demo-shape shards per fast-path round")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--writers", type=lambda s: [int(x) for x in s.split(",")], default=None, metavar="N[,N...]",
                    help="instead: simulate N writer identities (e.g. 64,256,1024) and measure the trainer's "
                    "planning/reading cost per step and the files the store keeps")
    ap.add_argument("--sim-steps", type=int, default=40, help="simulated trainer steps per writer count")
    ap.add_argument("--sim-warmup", type=int, default=5, help="first steps not timed")
    ap.add_argument("--sim-step-samples", type=int, default=512, help="samples per trainer step")
    ap.add_argument("--sim-group-size", type=int, default=8, help="samples per group (GRPO n_samples)")
    ap.add_argument("--sim-shard-groups", type=int, default=4, help="groups per published shard")
    ap.add_argument("--sim-commit-every", type=int, default=5, help="commit (checkpoint) every N steps")
    args = ap.parse_args(argv)
    parent = args.dir or Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix=".bench-store-", dir=parent))
    try:
        res = main_writers(base, args) if args.writers else run(base, args)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(json.dumps(res))
    elif args.writers:
        for row in res.pop("runs"):
            print("  ".join(f"{k}={v}" for k, v in row.items()))
        for k, v in res.items():
            print(f"{k:28s} {v}")
    else:
        for k, v in res.items():
            print(f"{k:28s} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
