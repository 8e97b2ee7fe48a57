"""Paired differences of an A/B (tools/bench_cmp/ab.sh): ``python3 pairs.py /tmp/ab/colocate-greedy 12``.

For each phase, each rep's median over its last three quarters of steps, new minus base: the mean with its standard
error, and the median; ``interval`` is the wall time from one step's metrics record to the next (the step as the
run lives it: ``perf/step_time`` leaves out the writing of the step's own record and what follows it). Also checks
that both sides did the same work: the sum of rewards and trained tokens of every rep (equal on both sides with
greedy decoding, ``EXTRA="--set rollout.sampling.temperature=0"``)."""

from __future__ import annotations

import itertools
import math
import statistics
import sys

from summ import records  # type: ignore[import-not-found]

KEYS = ("interval", "step", "rollout", "train", "store_write", "store_read", "reward", "prepare", "update_weights")


def rep(run_dir: str) -> dict[str, float]:
    from pathlib import Path

    recs = [r for r in records(Path(run_dir)) if "rollout/reward" in r]
    tail = recs[len(recs) // 4:]
    out = {k: 1e3 * statistics.median(r[f"perf/{k}_time"] for r in tail if f"perf/{k}_time" in r) for k in KEYS[1:]}
    times = [r["_time"] for r in tail]
    out["interval"] = 1e3 * statistics.median(b - a for a, b in itertools.pairwise(times))
    out["work"] = hash((round(sum(r["rollout/reward"] for r in tail), 4), sum(r["train/tokens"] for r in tail)))
    return out


def main() -> None:
    prefix, reps = sys.argv[1], int(sys.argv[2])
    runs = {(s, r): rep(f"{prefix}-{s}-{r}") for s in ("base", "new") for r in range(1, reps + 1)}
    for k in KEYS:
        d = [runs["new", r][k] - runs["base", r][k] for r in range(1, reps + 1)]
        base = statistics.median(runs["base", r][k] for r in range(1, reps + 1))
        new = statistics.median(runs["new", r][k] for r in range(1, reps + 1))
        print(f"{k:15s} base {base:6.2f} new {new:6.2f} ms   new - base: mean {statistics.mean(d):+.2f} "
              f"+- {statistics.stdev(d) / math.sqrt(reps):.2f}, median {statistics.median(d):+.2f}")
    same = len({runs[s, r]["work"] for s in ("base", "new") for r in range(1, reps + 1)}) == 1
    print("the same work on both sides in every rep:", same)


if __name__ == "__main__":
    main()
