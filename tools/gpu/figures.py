"""One JSON line with the figures issues 17 and 18 ask for, from one ``relax-hpc bench pipeline --json`` result.

    python3 tools/gpu/figures.py NAME RESULT.json >> $OUT/figures.jsonl

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


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: figures.py NAME RESULT.json", file=sys.stderr)
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
