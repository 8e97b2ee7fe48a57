"""Delta weight snapshots vs full ones: bytes per version, publish and reconstruct time, changed-bytes fraction.

``relax-hpc bench snapshots --delta [--lr 1e-6 --lr 2e-3] [--steps 12] [--from RUN_DIR ...] [--gb 0.25] [--json]``
``relax-hpc bench snapshots --delta --model [PATH] [--lr 1e-6] [--model-steps 12] [--form bf16 ...]``

With ``--model`` the source is a real pretrained model on a few CPU training steps (SmolLM2-135M-Instruct by
default): bytes per version by the distance to the base, the amortised bytes per version for every ``every_full``,
and cold/warm reconstruction rates beside a plain safetensors load (:mod:`relax_hpc.bench.delta_model`).

Otherwise two sources of consecutive versions:

* a real training run of the demo recipe (tiny Qwen3, bf16 weights, on the CPU) at each ``--lr`` (the shipped
  recipes use 1e-6; the demo 2e-3), every version kept (``weights.keep_last`` large); or ``--from`` existing run dirs;
* a model-shaped state dict of ``--gb`` GB (bf16 matrices with std 0.02, fp32 norms) updated like Adam on fp32 master
  weights (``master += lr * sign(noise)``) and published as bf16: the same rounding that decides which bf16
  elements change, at a size where publish/reconstruct rates mean something.

Each source's versions are published three times into fresh run dirs under ``--dir``: full (no delta), delta with
``xor-zstd`` and with ``sparse`` (``every_full``, ``max_fraction`` as given). Reported per source: the fraction of
elements and bytes changed per step (median, max), bytes written per version (mean over all versions including
the full bases) and of the deltas alone, publish seconds per version (median), and reconstruct rate (GB of full
state per second, median over versions, each loaded and verified with sha256; page cache warm).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from relax_hpc.bench.common import DEMO_RECIPE, model_like_state_dict


def train_versions(lr: float, steps: int, root: Path) -> Path:
    """Run the demo (colocate, bf16) for ``steps`` RL steps at ``lr`` keeping every version; its run dir."""
    run = root / f"demo-lr{lr:g}"
    cmd = [sys.executable, "-m", "relax_hpc", "submit", str(DEMO_RECIPE), "--executor", "local", "--run-dir",
           str(run), "--set", f"num_steps={steps}", "--set", f"trainer.lr={lr}", "--set", "model.dtype=bfloat16",
           "--set", "weights.keep_last=100000", "--set", "trainer.checkpoint_every=100000"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"demo run at lr {lr:g} failed: {p.stderr[-2000:]}")
    return run


def run_versions(run: Path) -> list[dict[str, Any]]:
    """Every kept version of a run dir, in order, as CPU state dicts."""
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights import complete_versions, load_snapshot

    rd = RunDir.open(run)
    return [load_snapshot(rd.snapshot(v))[0] for v in complete_versions(rd)]


def synthetic_versions(gb: float, n: int, lr: float) -> list[dict[str, Any]]:
    """``n`` versions of a model-shaped state dict: Adam-like steps on fp32 masters, published as bf16."""
    import torch


    base = model_like_state_dict(gb)
    g = torch.Generator().manual_seed(1)
    master = {k: (v.float() * 0.02 if v.dtype == torch.bfloat16 else v.float()) for k, v in base.items()}
    out = []
    for _ in range(n):
        out.append({k: m.to(base[k].dtype) for k, m in master.items()})
        for m in master.values():
            m.add_(torch.randn(m.shape, generator=g).sign_().mul_(lr))
    return out


def changed(states: list[dict[str, Any]]) -> dict[str, float]:
    """Fractions of elements and of bytes that differ between consecutive versions (median and max over steps)."""
    import torch

    elems, byts = [], []
    for a, b in itertools.pairwise(states):
        n = diff = nb = db = 0
        for k, t in b.items():
            ne = a[k].view(torch.uint8).reshape(-1) != t.view(torch.uint8).reshape(-1)
            diff += int((a[k] != t).sum()) if t.is_floating_point() else int(ne.sum())
            n += t.numel()
            db += int(ne.sum())
            nb += ne.numel()
        elems.append(diff / n)
        byts.append(db / nb)
    if not elems:
        return {}
    return {"changed_elements_median": statistics.median(elems), "changed_elements_max": max(elems),
            "changed_bytes_median": statistics.median(byts), "changed_bytes_max": max(byts)}


def publish_all(states: list[dict[str, Any]], root: Path, policy: Any) -> dict[str, float]:
    """Publish ``states`` as versions 1..n (with ``policy``: deltas), then reconstruct each; figures."""
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights import SnapshotPublisher, load_snapshot
    from relax_hpc.weights.manifest import read_manifest

    rd = RunDir.create(Path(tempfile.mkdtemp(dir=root)) / "run")
    pub = SnapshotPublisher(rd, keep_last=len(states) + 1, delta=policy)
    written, pub_s = [], []
    full = 0
    for i, sd in enumerate(states, 1):
        pub.wait_housekeeping()
        t0 = time.perf_counter()
        folder = pub.publish(sd, version=i, step=i)
        pub_s.append(time.perf_counter() - t0)
        m = read_manifest(folder)
        written.append(m["total_bytes"])
        full = max(full, (m.get("delta") or {}).get("full_bytes", m["total_bytes"]))
    pub.wait_housekeeping()
    load_s, delta_load_s, delta_sizes = [], [], []
    for i in range(1, len(states) + 1):
        t0 = time.perf_counter()
        load_snapshot(rd.snapshot(i))
        load_s.append(time.perf_counter() - t0)
        if read_manifest(rd.snapshot(i)).get("delta"):
            delta_load_s.append(load_s[-1])
            delta_sizes.append(written[i - 1])
    res = {"bytes_per_version": statistics.mean(written), "of_full": statistics.mean(written) / full,
           "deltas": len(delta_sizes), "versions": len(states), "publish_s": statistics.median(pub_s),
           "reconstruct_gb_s": full / 1e9 / statistics.median(load_s), "full_bytes": full}
    if delta_sizes:  # the deltas alone (without the full bases between them)
        res.update(delta_of_full=statistics.mean(delta_sizes) / full,
                   delta_reconstruct_gb_s=full / 1e9 / statistics.median(delta_load_s))
    return res


def measure(states: list[dict[str, Any]], root: Path, every_full: int, max_fraction: float) -> dict[str, Any]:
    from relax_hpc.weights import DeltaPolicy

    res: dict[str, Any] = {**changed(states), "full": publish_all(states, root, None)}
    for codec in ("xor-zstd", "sparse"):
        res[codec] = publish_all(states, root, DeltaPolicy(every_full, max_fraction, codec))  # type: ignore[arg-type]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="relax-hpc bench snapshots --delta", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lr", type=float, action="append",
                    help="demo runs at these learning rates (default: 1e-6 unless --from is given)")
    ap.add_argument("--steps", type=int, default=12, help="RL steps of each demo run (default 12)")
    ap.add_argument("--from", dest="runs", type=Path, action="append", default=[], help="measure this run dir too")
    ap.add_argument("--gb", type=float, default=0.25, help="size of the synthetic model (0: skip; default 0.25)")
    ap.add_argument("--synthetic-versions", type=int, default=6, help="versions of the synthetic model")
    ap.add_argument("--every-full", type=int, default=10)
    ap.add_argument("--max-fraction", type=float, default=0.5)
    ap.add_argument("--model", nargs="?", type=Path, const=Path("default"), default=None,
                    help="a real pretrained model trained a few CPU steps (default path: SmolLM2-135M-Instruct)")
    ap.add_argument("--model-steps", type=int, default=12, help="training steps of --model (default 12)")
    ap.add_argument("--form", action="append", choices=("bf16", "fp32-master->bf16", "float32"),
                    help="how the --model trainer holds and publishes weights (repeatable; default all three)")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to publish")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if not args.dir.is_dir():
        print(f"error: --dir {args.dir} is not a folder", file=sys.stderr)
        return 2
    if args.steps < 1 or args.every_full < 1 or not 0 < args.max_fraction <= 1 or args.gb < 0:
        print("error: --steps and --every-full must be >= 1, --max-fraction in (0, 1], --gb >= 0", file=sys.stderr)
        return 2
    if args.model is not None:
        return model_main(args)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-delta-") as tmp:
        root = Path(tmp)
        lrs = args.lr if args.lr is not None else ([] if args.runs else [1e-6])
        runs = [(f"demo lr={lr:g}", train_versions(lr, args.steps, root)) for lr in lrs]
        runs += [(f"run {r}", r) for r in args.runs]
        for label, run in runs:
            out[label] = measure(run_versions(run), root, args.every_full, args.max_fraction)
        if args.gb > 0:
            states = synthetic_versions(args.gb, args.synthetic_versions, 1e-6)
            out[f"synthetic {args.gb:g} GB lr=1e-06"] = measure(states, root, args.every_full, args.max_fraction)
    if args.json:
        print(json.dumps(out))
        return 0
    for label, res in out.items():
        print(f"{label}: changed elements/step median {res.get('changed_elements_median', 0):.4%} "
              f"(max {res.get('changed_elements_max', 0):.4%}), changed bytes/step median "
              f"{res.get('changed_bytes_median', 0):.4%}")
        for kind in ("full", "xor-zstd", "sparse"):
            r = res[kind]
            print(f"  {kind:>9}: {r['bytes_per_version'] / 1e6:10.3f} MB/version ({r['of_full']:.1%} of full, "
                  f"{r['deltas']}/{r['versions']} deltas), publish {r['publish_s'] * 1e3:8.1f} ms, "
                  f"reconstruct {r['reconstruct_gb_s']:.2f} GB/s"
                  + (f"; deltas alone {r['delta_of_full']:.1%} of full, reconstructed at "
                     f"{r['delta_reconstruct_gb_s']:.2f} GB/s" if "delta_of_full" in r else ""))
    return 0


def model_main(args: argparse.Namespace) -> int:
    """``--model``: the real-model source (relax_hpc.bench.delta_model)."""
    from relax_hpc.bench import delta_model

    path = delta_model.DEFAULT_MODEL if str(args.model) == "default" else args.model.expanduser()
    if not (path / "config.json").is_file():
        print(f"error: --model {path} is not a model folder (config.json missing)", file=sys.stderr)
        return 2
    if args.model_steps < 1:
        print("error: --model-steps must be >= 1", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-delta-") as tmp:
        for lr in args.lr or [1e-6]:
            for res in delta_model.measure_forms(path, args.form or list(delta_model.FORMS), lr,
                                                 args.model_steps, Path(tmp)):
                results.append(res)
                if not args.json:
                    print(delta_model.report(res), flush=True)
    if args.json:
        print(json.dumps({"model": str(path), "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
