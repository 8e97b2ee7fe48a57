"""Median per-step metrics of A/B run dirs (tools/bench_cmp/ab.sh): ``python3 summ.py /tmp/ab/<mode>-*``.

Reads the trainer's (fully_async) or colocate rank 0's metric records, skips the first quarter of the steps, and
prints the median of each ``perf/*`` metric in ms and the mean reward of the last 50 steps."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def records(run_dir: Path) -> list[dict[str, float]]:
    events = run_dir / "logs" / "events"
    out = []
    for f in sorted(events.glob("trainer*.jsonl")) + sorted(events.glob("colocate*.jsonl")):
        for line in f.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            if r.get("kind") == "metrics" and r.get("rank", 0) == 0:
                out.append({**r["metrics"], "_time": r["time"]})
    return out


def summary(recs: list[dict[str, float]]) -> str:
    tail = recs[len(recs) // 4:]
    keys = sorted({k for r in tail for k in r if k.startswith("perf/") and k.endswith("_time")})
    parts = []
    for k in keys:
        v = [r[k] for r in tail if isinstance(r.get(k), (int, float))]
        if v:
            parts.append(f"{k.split('/')[-1]}={statistics.median(v) * 1000:.2f}")
    rewards = [r["rollout/reward"] for r in recs[-50:] if "rollout/reward" in r]
    if rewards:
        parts.append(f"reward={statistics.mean(rewards):.3f}")
    return " ".join(parts)


def main() -> None:
    for d in map(Path, sys.argv[1:]):
        if d.is_dir():
            recs = records(d)
            print(d.name, len(recs), summary(recs) if recs else "no metrics")


if __name__ == "__main__":
    main()
