"""Paired differences of a ``bench pipeline`` A/B (``tools/bench_cmp/ab.sh pipeline N STEPS``):
``python3 pipe_pairs.py /tmp/ab/pipeline-TAG N``.

Per figure: the median of each side over the reps, and new minus base per rep (mean ± standard error, median)."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

KEYS = ("colocate_step_ms_median", "fully_async_step_ms_median", "colocate_seconds", "fully_async_seconds",
        "speedup", "speedup_median", "efficiency_vs_ideal", "t_gen", "t_train")


def main() -> None:
    prefix, reps = sys.argv[1], int(sys.argv[2])
    runs = {(s, r): json.loads(Path(f"{prefix}-{s}-{r}.json").read_text())
            for s in ("base", "new") for r in range(1, reps + 1)}
    for k in KEYS:
        scale = 1e3 if k.startswith("t_") else 1.0  # seconds -> ms
        d = [scale * (runs["new", r][k] - runs["base", r][k]) for r in range(1, reps + 1)]
        base = scale * statistics.median(runs["base", r][k] for r in range(1, reps + 1))
        new = scale * statistics.median(runs["new", r][k] for r in range(1, reps + 1))
        print(f"{k:28s} base {base:8.3f} new {new:8.3f}   new - base: mean {statistics.mean(d):+.3f} "
              f"+- {statistics.stdev(d) / math.sqrt(reps):.3f}, median {statistics.median(d):+.3f}")


if __name__ == "__main__":
    main()
