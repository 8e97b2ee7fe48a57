"""One JSON line of headline figures, from one ``relax-hpc bench pipeline --json`` result or from the rank files of
the megatron parity worker (tests' ``megatron_tp_worker.py``). ``tools/gpu/suite.sh multi-gpu`` appends them to
``$OUT/figures.jsonl``::

    python3 tools/gpu/figures.py NAME RESULT.json
    python3 tools/gpu/figures.py --parity NAME RANK_DIR RC

A result that is missing or does not parse gives a line ``{"run": NAME, "error": ...}`` (and exit code 1), so a
failed run still leaves a line saying so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def figures(name: str, r: dict[str, Any]) -> dict[str, Any]:
    """The headline figures of one pipeline result (seconds per step, speedup against the ideal bound, busy
    fractions, hand-over per version by path, final rewards, training throughput)."""
    steps = r["timed_steps"]
    busy = r.get("gpu_busy") or {}
    ho = r.get("handover") or {}
    fast, files = ho.get("fast_path_run") or {}, ho.get("files_run") or {}
    backends = sorted(set((fast.get("fast_path_backends") or {}).values()))
    tp = r.get("train_throughput") or {}
    return {
        "run": name, "shape": r.get("shape"), "device": r.get("device"), "gpus": r.get("gpus"),
        "gpu": (r.get("machine") or {}).get("gpu"), "steps": r["steps"], "timed_steps": steps,
        "layout": r.get("layout"), "role_times": r.get("role_times"),
        "colocate_s_per_step": r["colocate_seconds"] / steps,
        "fully_async_s_per_step": r["fully_async_seconds"] / steps,
        "speedup": r["speedup"], "speedup_median": r["speedup_median"], "t_gen": r["t_gen"], "t_train": r["t_train"],
        "ideal_speedup": r["ideal_speedup"], "efficiency_vs_ideal": r["efficiency_vs_ideal"],
        "speedup_over_ideal": r["speedup"] / r["ideal_speedup"] if r.get("ideal_speedup") else None,
        "gpu_busy_colocate": busy.get("colocate"), "gpu_busy_fully_async": busy.get("fully_async"),
        "gpu_busy_trainer_mean": busy.get("fully_async_trainer_mean"),
        "gpu_busy_rollout_mean": busy.get("fully_async_rollout_mean"), "gpu_samples": busy.get("samples"),
        "trainer_idle_fraction": r["trainer_idle_fraction"], "rollout_idle_fraction": r["rollout_idle_fraction"],
        "final_reward_colocate": r["final_reward_colocate"], "final_reward_fully_async": r["final_reward_fully_async"],
        "staleness_mean": r["staleness_mean"],
        "handover_fast_s": fast.get("load_s_fast_median"), "handover_fast_loads": fast.get("loads_fast"),
        "handover_files_s": files.get("load_s_files_median"), "handover_files_loads": files.get("loads_files"),
        "publish_s": fast.get("publish_s_median"), "fast_path_backends": backends,
        "fast_path_is_nccl": backends == ["nccl"] if backends else None,
        "train_tokens_per_s": {m: t.get("tokens_per_s") for m, t in tp.items()},
        "train_mfu": {m: t.get("mfu") for m, t in tp.items()},
        "trainer_backend": (tp.get("fully_async") or {}).get("backend"), "tp": (tp.get("fully_async") or {}).get("tp"),
        "warnings": r.get("warnings"),
    }


def parity(name: str, folder: Path, rc: int) -> dict[str, Any]:
    """The largest differences of logits, log-probs, entropy, gradients and updated weights over the ranks of one
    megatron parity run (TP=2 or TP=1 x DP=2 against the HF model and the torch backend)."""
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    keys = ("logits", "logprobs", "entropy", "grads", "weights_after")
    first = ranks[0] if ranks else {}
    return {"run": name, "rc": rc, "ranks": len(ranks),
            **{f"max_{k}": max((r[k] for r in ranks if k in r), default=None) for k in keys},
            **{k: first.get(k) for k in ("tp_size", "dp_size", "loss_megatron", "loss_torch")}}


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "--parity":
        try:
            print(json.dumps(parity(argv[1], Path(argv[2]), int(argv[3]))))
        except (OSError, ValueError) as exc:
            print(json.dumps({"run": argv[1], "error": f"{type(exc).__name__}: {exc}"}))
            return 1
        return 0
    if len(argv) != 2:
        print("usage: figures.py NAME RESULT.json | figures.py --parity NAME RANK_DIR RC", file=sys.stderr)
        return 2
    name, path = argv
    try:
        line = figures(name, json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        print(json.dumps({"run": name, "error": f"{type(exc).__name__}: {exc}"}))
        return 1
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
