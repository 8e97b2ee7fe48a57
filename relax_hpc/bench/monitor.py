"""Monitor benchmark: how long a refresh of a big run takes, and how much CPU the live view uses while idle.

Generates a run dir (64 roles, 100k metric lines by default) with the real :class:`~relax_hpc.events.EventLog` and
:class:`~relax_hpc.events.Heartbeat` writers in a temporary folder, then measures

* the first read (every line parsed once),
* a refresh after each round of appends (one metrics line per process, a few heartbeats), read + snapshot and
  the rich rendering separately,
* the CPU time of the live loop (``--interval``) over an idle period (``--idle-s``), nothing being written.

``python -m relax_hpc.bench.monitor [--json]``; ``main(argv)`` is what a bench command calls.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from relax_hpc.events import EventLog, Heartbeat
from relax_hpc.fsio import atomic_write_json
from relax_hpc.rundir import RunDir


def _trainer_metrics(step: int, rng: random.Random) -> dict[str, float]:
    return {"rollout/reward": 0.2 + 0.6 * (1 - math.exp(-step / 3000)) + rng.gauss(0, 0.03),
            "train/loss": 0.05 * math.exp(-step / 5000) + rng.gauss(0, 0.005), "train/kl_loss": 1e-3 + 1e-7 * step,
            "train/entropy_loss": 1.2 - 1e-5 * step, "train/pg_clipfrac": 0.02 + rng.random() * 0.02,
            "train/grad_norm": 0.5 + rng.random(), "rollout/response_length": 180 + rng.gauss(0, 10),
            "perf/samples_per_s": 60 + rng.gauss(0, 3), "perf/tokens_per_s": 11000 + rng.gauss(0, 500),
            "perf/step_time": 2.1 + rng.random() * 0.2, "perf/train_idle_fraction": 0.1 + rng.random() * 0.05,
            "perf/rollout_idle_fraction": 0.05 + rng.random() * 0.05,
            "rollout/staleness_mean": 0.6 + rng.random() * 0.4,
            "store/backlog_samples": 256 + rng.randrange(64), "weights/version": step}


def _rollout_metrics(i: int, rng: random.Random) -> dict[str, float]:
    return {"rollout/gen_tokens_per_s": 800 + rng.gauss(0, 40), "rollout/batch_reward": rng.random(),
            "rollout/response_length": 180 + rng.gauss(0, 10), "rollout/samples_written": i * 64}


class SyntheticRun:
    """A run dir filled by real writers: ``trainer-0`` and ``num_roles - 1`` rollout workers."""

    def __init__(self, root: Path, *, num_roles: int = 64, num_steps: int = 100_000, seed: int = 0,
                 name: str = "bench", dead_after_s: float = 120.0):
        self.rd = RunDir.create(root, name=name)
        atomic_write_json(self.rd.config, {"name": name, "mode": "fully_async", "num_steps": num_steps,
                                           "monitor": {"dead_after_s": dead_after_s, "stall_minutes": 15.0}})
        self.rng = random.Random(seed)
        self.procs = [("trainer", 0)] + [("rollout", i) for i in range(num_roles - 1)]
        self.logs = {p: EventLog(self.rd, *p) for p in self.procs}
        self.beats = {p: Heartbeat(self.rd, *p, min_interval_s=0.0) for p in self.procs}
        self.step = 0
        self.rollout_lines = 0

    def append(self, lines: int, *, trainer_share: float = 0.5) -> None:
        """Write ``lines`` metric lines: ``trainer_share`` of them trainer steps, the rest spread over workers."""
        n_train = int(lines * trainer_share)
        train_log = self.logs[("trainer", 0)]
        for _ in range(n_train):
            self.step += 1
            train_log.metrics(_trainer_metrics(self.step, self.rng), step=self.step)
        workers = self.procs[1:] or self.procs
        for k in range(lines - n_train):
            self.rollout_lines += 1
            self.logs[workers[k % len(workers)]].metrics(_rollout_metrics(self.rollout_lines, self.rng))
        self.beat()

    def beat(self, procs: list[tuple[str, int]] | None = None) -> None:
        for p in procs or self.procs:
            trainer = p == self.procs[0]
            self.beats[p].beat(state="running", step=self.step if trainer else None,
                               version=max(0, self.step - (not trainer)))

    def close(self) -> None:
        for log in self.logs.values():
            log.close()


def _render_s(snap: dict[str, Any]) -> float:
    from rich.console import Console

    from relax_hpc.monitor.view import run_view

    console = Console(file=io.StringIO(), width=160, height=60, force_terminal=True)
    t = time.perf_counter()
    console.print(run_view(snap, max_role_rows=38))
    return time.perf_counter() - t


def run_benchmark(root: Path, *, num_roles: int, num_lines: int, rounds: int, idle_s: float,
                  interval_s: float) -> dict[str, Any]:
    """Generate the run in ``root`` and measure; returns the figures (seconds, fractions, counts)."""
    from rich.console import Console

    from relax_hpc.monitor.live import Monitor, watch
    from relax_hpc.monitor.progress import progress
    from relax_hpc.monitor.state import RunMonitor

    run = SyntheticRun(root, num_roles=num_roles)
    t = time.perf_counter()
    chunk = max(1, num_lines // 50)
    with progress(num_lines, "writing metric lines", unit="lines", transient=True) as bar:
        for done in range(0, num_lines, chunk):
            run.append(min(chunk, num_lines - done))
            bar.advance(min(chunk, num_lines - done))
    write_s = time.perf_counter() - t
    size = sum(p.stat().st_size for p in run.rd.events.glob("*.jsonl"))

    mon = RunMonitor(run.rd)
    t = time.perf_counter()
    snap = mon.refresh()
    first_s = time.perf_counter() - t
    first_render_s = _render_s(snap)
    assert snap["lines_read"] == num_lines, (snap["lines_read"], num_lines)

    refresh, render = [], []
    for _ in range(rounds):
        run.append(num_roles)  # one line per process on average
        run.beat(run.procs[:8])
        t = time.perf_counter()
        snap = mon.refresh()
        refresh.append(time.perf_counter() - t)
        render.append(_render_s(snap))
    run.close()

    live = Monitor(mon, alerts=False)
    devnull = open(os.devnull, "w")  # noqa: SIM115 -- closed below
    try:
        console = Console(file=devnull, width=160, height=60, force_terminal=True)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        refreshes = watch(live, interval_s=interval_s, duration_s=idle_s, console=console)
        idle_cpu_s, idle_wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    finally:
        devnull.close()
    total = [a + b for a, b in zip(refresh, render, strict=True)]
    return {
        "roles": num_roles, "metric_lines": num_lines, "event_bytes": size, "write_s": write_s,
        "first_read_s": first_s, "first_render_s": first_render_s,
        "refresh_rounds": rounds, "refresh_median_s": statistics.median(refresh), "refresh_max_s": max(refresh),
        "render_median_s": statistics.median(render), "refresh_plus_render_max_s": max(total),
        "idle_interval_s": interval_s, "idle_wall_s": idle_wall_s, "idle_cpu_s": idle_cpu_s,
        "idle_refreshes": refreshes, "idle_cpu_fraction": idle_cpu_s / idle_wall_s if idle_wall_s else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="relax-hpc bench monitor", description=__doc__.splitlines()[0])
    p.add_argument("--roles", type=int, default=64, help="processes in the run (1 trainer + rollout workers)")
    p.add_argument("--lines", type=int, default=100_000, help="metric lines written before the first read")
    p.add_argument("--rounds", type=int, default=20, help="append + refresh rounds measured")
    p.add_argument("--idle-s", type=float, default=10.0, help="idle period of the live loop measured for CPU")
    p.add_argument("--interval", type=float, default=2.0, help="refresh period of the live loop (the CLI default)")
    p.add_argument("--dir", type=Path, default=None, help="where to build the run (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    if args.roles < 1 or args.lines < 1 or args.rounds < 1:
        p.error("--roles, --lines and --rounds must be at least 1")
    with tempfile.TemporaryDirectory(prefix="relax-bench-monitor-") as tmp:
        root = args.dir if args.dir is not None else Path(tmp) / "run"
        r = run_benchmark(root, num_roles=args.roles, num_lines=args.lines, rounds=args.rounds,
                          idle_s=args.idle_s, interval_s=args.interval)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"run: {r['roles']} roles, {r['metric_lines']:,} metric lines, {r['event_bytes'] / 1e6:.1f} MB "
          f"(written in {r['write_s']:.1f} s)")
    print(f"first read:  {r['first_read_s'] * 1e3:8.1f} ms   render {r['first_render_s'] * 1e3:.1f} ms")
    print(f"refresh:     {r['refresh_median_s'] * 1e3:8.1f} ms median, {r['refresh_max_s'] * 1e3:.1f} ms max over "
          f"{r['refresh_rounds']} rounds of +{r['roles']} lines; render {r['render_median_s'] * 1e3:.1f} ms median; "
          f"refresh+render max {r['refresh_plus_render_max_s'] * 1e3:.1f} ms")
    print(f"idle live loop: {r['idle_cpu_s'] * 1e3:.0f} ms CPU over {r['idle_wall_s']:.1f} s "
          f"({r['idle_refreshes']} refreshes every {r['idle_interval_s']:g} s) = "
          f"{r['idle_cpu_fraction'] * 100:.2f}% of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
