"""``relax-hpc bench pipeline``: colocate vs fully_async on the demo recipe, same trainer steps, same cores.

``relax-hpc bench pipeline [--json] [--steps 60] [--set KEY=VALUE ...] [--device cpu|cuda] [--out DIR] [--keep]``

Layout. Two CPUs A, B (``--cores``; default the first two this process may use). colocate: one process pinned to
{A, B} with 2 threads. fully_async: one trainer pinned to A and one rollout worker pinned to B, 1 thread each
(``launch.<role>.cpu_affinity``). With ``--device cuda`` every role also uses the same GPU.

Timing. Each mode's seconds come from the trainer's metric lines (event-log timestamps), from the end of step 1 to
the end of the last step: process start-up, the supervised warm-up and step 1 (first-call allocations, the pipeline
filling) are excluded from both modes alike, so ``timed_steps = steps - 1``.

The bound. ``t_gen`` (generating one step's prompts_per_step x n_samples completions with the hf engine) and
``t_train`` (forward + backward + optimizer step on such a batch) are measured alone, after both runs, each in a
subprocess pinned like its role in the fully_async layout (same CPU, same threads, same device), with the recipe's
settings and the weights the fully_async run ended with (so response lengths are those of the end of the run).
A perfect pipeline is bounded by its slower role::

    efficiency_vs_ideal = timed_steps * max(t_gen, t_train) / fully_async_seconds
    ideal_speedup       = (t_gen + t_train) / max(t_gen, t_train)   # overlap alone, vs taking turns

The same two processes then measure both roles at once (``t_gen_corun``, ``t_train_corun``,
``efficiency_vs_corun``): what each role's compute gets when the other core is busy too (shared caches, memory
bandwidth, the host's scheduling of a VM's vCPUs).

Everything else a step does (rewards, store writes and reads, snapshot publishing, weight loading, polling, logging)
counts against the pipeline; ``breakdown`` says where it goes (ms per trainer step, over the timed steps). A role's
``busy`` time is the time in its timed phases; ``idle = 1 - busy / seconds`` (waiting for the other role, plus the
untimed loop overhead: ``wait`` and ``pause`` are the waiting part alone).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_hpc.bench.common import (
    DEMO_RECIPE,
    ScratchDirs,
    interrupt,
    machine,
    metric_value,
    print_fields,
    read_records,
    report,
    run_guarded,
)
from relax_hpc.bench.gpus import GpuLayout, GpuSampler, one_role
from relax_hpc.bench.step import SHAPES as STEP_SHAPES
from relax_hpc.rundir import RunDir

if TYPE_CHECKING:
    from relax_hpc.config.schema import RecipeConfig

TIMING = ("trainer event-log timestamps from the end of step 1 to the end of the last step; process start-up, the "
          "supervised warm-up and step 1 are excluded")
TRAINER_PHASES = {  # breakdown name -> metric of the trainer-side metric line (per step)
    "plan": "perf/store_plan_time", "read": "perf/store_read_time", "prepare": "perf/prepare_time",
    "train_compute": "perf/train_time", "weight_handover": "perf/update_weights_time",
    "checkpoint": "perf/checkpoint_time",
}
COLOCATE_PHASES = {
    "generate": "perf/rollout_time", "reward": "perf/reward_time", "store_write": "perf/store_write_time",
    "plan_read": "perf/store_read_time", "prepare": "perf/prepare_time", "train_compute": "perf/train_time",
    "publish": "perf/update_weights_time", "checkpoint": "perf/checkpoint_time",
}
ROLLOUT_PHASES = {
    "generate": "rollout/generate_time", "reward": "perf/reward_time", "store_write": "perf/store_write_time",
    "weight_load": "perf/update_weights_time",
}


# ------------------------------------------------------------------------------------------------ running a mode
@dataclass
class ModeRun:
    """One finished run of a mode: its run dir, exit code and the metric lines of its processes."""

    mode: str
    run_dir: RunDir
    exit_code: int
    steps: list[dict[str, Any]]
    """The trainer side's metric records of steps >= 1 (``time`` + ``metrics``), in step order."""
    rollout: list[dict[str, Any]] = field(default_factory=list)
    """The rollout worker's metric records (fully_async)."""
    finished: bool = False


def run_mode(recipe: Path, overrides: list[str], root: Path, *, timeout_s: float) -> ModeRun:
    """Create a run dir, launch the recipe's roles as local processes, wait (at most ``timeout_s``), read logs."""
    from relax_hpc.cli.submit import prepare_run_dir
    from relax_hpc.errors import WaitTimeout
    from relax_hpc.launch import local

    run_dir, cfg = prepare_run_dir(argparse.Namespace(recipe=str(recipe), overrides=overrides, run_dir=str(root)))
    procs = local.launch(run_dir, cfg)
    deadline = time.monotonic() + timeout_s

    def check_deadline() -> None:
        if time.monotonic() > deadline:
            raise WaitTimeout(f"{cfg.mode} run did not finish within {timeout_s:.0f}s; logs: {run_dir.logs}")

    from relax_hpc.launch.follow import ProgressFeed

    feed = ProgressFeed(run_dir, cfg)  # a progress bar on stderr (stdout stays clean for --json)

    def tick() -> None:
        feed.tick()
        check_deadline()

    try:
        code = local.supervise(run_dir, cfg, procs, on_tick=tick, poll_s=0.2)
    finally:
        feed.close()
        local.terminate(procs, timeout_s=30)
    if code == 130:  # interrupted: supervise stopped the roles
        raise KeyboardInterrupt
    return read_mode_run(run_dir, cfg, code)


def read_mode_run(run_dir: RunDir, cfg: RecipeConfig, code: int) -> ModeRun:
    """The metric records of a run dir (finished or still running) as a :class:`ModeRun`."""
    from relax_hpc.roles.spec import main_proc  # the process logging the step metrics, from the role table

    recs = read_records(run_dir, main_proc(cfg))
    steps = [r for r in recs if r.get("kind") == "metrics" and (r.get("step") or 0) >= 1
             and "perf/step_time" in r.get("metrics", {})]
    finished = any(r.get("kind") == "event" and r.get("event") == "finished" for r in recs)
    rollout = [r for r in read_records(run_dir, "rollout-0") if r.get("kind") == "metrics"]
    return ModeRun(cfg.mode, run_dir, code, steps, rollout, finished)


# ------------------------------------------------------------------------------------------------ figures
def _sum(records: list[dict[str, Any]], key: str) -> float:
    return sum(metric_value(r["metrics"], key) for r in records)


def _fraction(x: float) -> float:
    """Clipped to [0, 1] (timers of different threads may overlap by a few ms)."""
    return min(1.0, max(0.0, x))


@dataclass
class Window:
    """The timed part of a run: trainer steps 2..N, from the end of step 1 to the end of step N."""

    start: float
    end: float
    steps: list[dict[str, Any]]

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def intervals(self) -> list[float]:
        """Seconds between the ends of consecutive timed steps."""
        times = [self.start] + [float(r["time"]) for r in self.steps]
        return [b - a for a, b in itertools.pairwise(times)]

    def median_interval(self) -> float:
        return statistics.median(self.intervals())


def timed_window(run: ModeRun, num_steps: int) -> Window:
    by_step = {int(r["step"]): r for r in run.steps}
    missing = [s for s in range(1, num_steps + 1) if s not in by_step]
    if missing:
        raise RuntimeError(f"{run.mode} run logged no metrics for steps {missing[:5]} (exit code {run.exit_code}); "
                           f"logs: {run.run_dir.logs}")
    return Window(float(by_step[1]["time"]), float(by_step[num_steps]["time"]),
                  [by_step[s] for s in range(2, num_steps + 1)])


def final_reward(run: ModeRun, last: int) -> tuple[float, float]:
    """Mean ``rollout/reward`` of the last ``last`` steps and its standard error (over steps)."""
    vals = [metric_value(r["metrics"], "rollout/reward") for r in run.steps[-last:]]
    vals = [v for v in vals if math.isfinite(v)]
    if not vals:
        return float("nan"), float("nan")
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, float("nan")
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return mean, math.sqrt(var / len(vals))


def per_step(records: list[dict[str, Any]], phases: dict[str, str], num_steps: int) -> dict[str, float]:
    """Seconds per trainer step spent in each phase (summed over ``records``, divided by ``num_steps``)."""
    return {name: _sum(records, key) / num_steps for name, key in phases.items()}


def summarize_colocate(run: ModeRun, w: Window) -> dict[str, Any]:
    n = w.num_steps
    phases = per_step(w.steps, COLOCATE_PHASES, n)
    step_time = _sum(w.steps, "perf/step_time") / n
    phases["other_in_step"] = step_time - sum(phases.values())
    phases["between_steps"] = w.seconds / n - step_time
    return {"seconds": w.seconds, "samples": _sum(w.steps, "train/samples"), "breakdown": phases}


def clip_cycles(records: list[dict[str, Any]], w: Window) -> list[tuple[float, dict[str, Any]]]:
    """The rollout worker's batches that overlap the timed window, each with the fraction of its cycle inside it.

    A batch's metric line ends its cycle (weight load, pause, generate, reward, write); the cycle started at the
    previous line (the first one: its own durations before its line). Phases are counted in proportion, so the
    window's totals are neither missed nor counted twice at its edges."""
    out = []
    prev: float | None = None
    for r in sorted((r for r in records if "rollout/generate_time" in r["metrics"]), key=lambda r: float(r["time"])):
        end = float(r["time"])
        m = r["metrics"]
        begin = prev if prev is not None else end - sum(metric_value(m, k) for k in (*ROLLOUT_PHASES.values(),
                                                                              "perf/rollout_pause_time"))
        prev = end
        overlap = min(end, w.end) - max(begin, w.start)
        if overlap > 0 and end > begin:
            out.append((overlap / (end - begin), r))
    return out


def summarize_async(run: ModeRun, w: Window) -> dict[str, Any]:
    n = w.num_steps
    tr = per_step(w.steps, TRAINER_PHASES, n)
    wait = (_sum(w.steps, "perf/train_wait_time") - _sum(w.steps, "perf/store_plan_time")) / n
    step_time = _sum(w.steps, "perf/step_time") / n
    trainer = {"wait": wait, **tr, "other_in_step": step_time - wait - sum(tr.values()),
               "between_steps": w.seconds / n - step_time}
    trainer_busy = sum(tr.values()) * n / w.seconds
    inside = clip_cycles(run.rollout, w)
    ro = {name: sum(f * metric_value(r["metrics"], key) for f, r in inside) / n for name, key in ROLLOUT_PHASES.items()}
    pause = sum(f * metric_value(r["metrics"], "perf/rollout_pause_time") for f, r in inside) / n
    rollout = {"pause": pause, **ro, "other": w.seconds / n - pause - sum(ro.values())}
    rollout_busy = sum(ro.values()) * n / w.seconds
    return {
        "seconds": w.seconds, "samples": _sum(w.steps, "train/samples"),
        "trainer_idle_fraction": _fraction(1.0 - trainer_busy),
        "trainer_wait_fraction": _fraction(wait * n / w.seconds),
        "rollout_idle_fraction": _fraction(1.0 - rollout_busy),
        "rollout_pause_fraction": _fraction(pause * n / w.seconds),
        "staleness_mean": _sum(w.steps, "rollout/staleness_mean") / n,
        "stale_dropped": _sum(w.steps, "rollout/stale_dropped"),
        "fast_path_fraction": (sum(metric_value(r["metrics"], "weights/fast_path_used") for _, r in inside)
                               / len(inside) if inside else 0.0),
        "rollout_batches": sum(f for f, _ in inside),
        "breakdown": {"trainer": trainer, "rollout": rollout},
    }


# ------------------------------------------------------------------------------------------------ roles alone
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


class GenWork:
    """The rollout worker's per-step work, set up once from a finished run (its config and newest snapshot), on the
    production path: an engine holding its own weights, the rollout driver. Per step: load the snapshot through
    the engine's sink, generate one step's prompts, score them, write the groups to a store."""

    def __init__(self, run_dir: RunDir):
        import torch

        from relax_hpc.models.load import load_tokenizer
        from relax_hpc.modes import components as C
        from relax_hpc.roles import load_run_config
        from relax_hpc.weights import latest_version

        self.cfg = cfg = load_run_config(run_dir)
        torch.set_num_threads(cfg.launch.rollout.cpus_per_task)
        C.seed_everything(cfg.seed)
        self.run_dir = run_dir
        self.tokenizer = load_tokenizer(cfg.model)
        self.version = latest_version(run_dir)
        self.engine = C.build_engine(cfg, self.tokenizer, seed=cfg.seed)
        self.stream = C.build_prompt_stream(cfg, self.tokenizer, seed_offset=1000)
        self.rewards = C.build_reward_runner(cfg, engine=self.engine, tokenizer=self.tokenizer, name="bench")

    def run(self, store: RunDir, writer: str, *, iters: int, warmup: int) -> tuple[dict[str, float], dict[str, float]]:
        """Mean and median seconds per step of each phase over ``iters`` steps (after ``warmup``)."""
        from relax_hpc.rollout.driver import RolloutDriver
        from relax_hpc.rollout.engine import SnapshotFolder
        from relax_hpc.rollout.hf_engine import sampling_params
        from relax_hpc.store import ShardWriter
        from relax_hpc.timing import PhaseTimer

        cfg = self.cfg
        driver = RolloutDriver(self.engine, self.tokenizer, self.rewards, writer_id=writer,
                               sampling=sampling_params(cfg.rollout.sampling, cfg.rollout.n_samples),
                               writer=ShardWriter(store, writer))
        folder = SnapshotFolder(self.run_dir.snapshot(self.version), cfg.weights.verify)
        times: dict[str, list[float]] = {k: [] for k in ROLLOUT_PHASES}
        for i in range(warmup + iters):
            timer = PhaseTimer()
            with timer.phase("weight_load"):
                driver.call(self.engine.receive(self.version, folder))
                _sync(str(getattr(self.engine, "device", "cpu")))
            driver.run_batch(self.stream.next_batch(cfg.rollout.prompts_per_step), timer)
            if i >= warmup:
                for k in times:
                    times[k].append(timer.get(k))
        driver.stop()
        return {k: _mean(v) for k, v in times.items()}, {k: statistics.median(v) for k, v in times.items()}


class TrainWork:
    """The trainer's per-step work, set up once from a finished run (its config and newest snapshot): plan and read
    one step's groups from a store, prepare them, train (forward + backward + optimizer step), publish a snapshot."""

    def __init__(self, run_dir: RunDir):
        import torch

        from relax_hpc.modes import components as C
        from relax_hpc.roles import load_run_config
        from relax_hpc.trainer.torch_trainer import TorchTrainer
        from relax_hpc.weights import SnapshotReader, latest_version

        self.cfg = cfg = load_run_config(run_dir)
        torch.set_num_threads(cfg.launch.trainer.cpus_per_task)
        C.seed_everything(cfg.seed)
        self.policy = C.build_policy(cfg, device_pref=cfg.trainer.device)
        SnapshotReader(run_dir, name="bench-alone").load_into(self.policy.model, latest_version(run_dir))
        self.algorithm = C.build_algorithm(cfg)
        ref, teacher = C.build_aux_models(cfg, self.policy)
        self.trainer = TorchTrainer(cfg, self.policy.model, device=self.policy.device, dtype=self.policy.dtype,
                                    algorithm=self.algorithm, ref_model=ref, teacher=teacher)

    def run(self, store: RunDir, consumer: str, snapshots: RunDir, *, iters: int,
            warmup: int) -> tuple[dict[str, float], dict[str, float]]:
        """Mean and median seconds per step of each phase over ``iters`` steps (after ``warmup``)."""
        from relax_hpc.store import ConsumerGroup
        from relax_hpc.trainer.items import samples_to_items
        from relax_hpc.trainer.prepare import prepare_items
        from relax_hpc.weights import SnapshotPublisher

        cfg, trainer = self.cfg, self.trainer
        group = ConsumerGroup(store, consumer, retention="keep")
        publisher = SnapshotPublisher(snapshots, keep_last=cfg.weights.keep_last)
        times: dict[str, list[float]] = {k: [] for k in ("plan", "read", "prepare", "train_compute", "publish")}
        for i in range(warmup + iters):
            t: dict[str, float] = {}
            t0 = time.perf_counter()
            plan = group.plan(i, num_groups=cfg.rollout.prompts_per_step, min_version=0, wait=False)
            t["plan"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            items = samples_to_items(group.read(plan))
            t["read"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            prep = prepare_items(items, cfg, self.algorithm)
            t["prepare"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            trainer.train_step(prep.items)
            _sync(self.policy.device)
            t["train_compute"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            publisher.publish(trainer.full_state_dict(), version=trainer.step, step=trainer.step)
            t["publish"] = time.perf_counter() - t0
            if i >= warmup:
                for k, v in t.items():
                    times[k].append(v)
        return {k: _mean(v) for k, v in times.items()}, {k: statistics.median(v) for k, v in times.items()}


def role_main(role: str, run_dir: RunDir, scratch: RunDir, *, iters: int, warmup: int,
              timeout_s: float) -> dict[str, dict[str, float]]:
    """One role's side of :func:`measure_roles`, in its pinned process. Phases, in order, handed over by marker
    files in ``scratch``: generation alone (writes the groups), training alone (on them), both at once
    (``corun``: generation writes more, training re-reads the first ones as another consumer)."""
    from relax_hpc.fsio import wait_for

    def mark(name: str) -> None:
        (scratch.root / name).touch()

    def await_mark(name: str) -> None:
        wait_for(lambda: (scratch.root / name).exists(), what=f"{name} in {scratch.root}", timeout_s=timeout_s,
                 poll_s=0.005, max_poll_s=0.05)

    kw = {"iters": iters, "warmup": warmup}
    if role == "gen":
        work = GenWork(run_dir)
        gc.freeze()  # as the roles do: no full collection (~0.5 s) inside a timed step
        alone = work.run(scratch, "bench-gen.0", **kw)
        mark("gen-alone.done")
        await_mark("train-alone.done")
        corun = work.run(scratch, "bench-corun.0", **kw)
    else:
        work2 = TrainWork(run_dir)
        gc.freeze()
        await_mark("gen-alone.done")
        alone = work2.run(scratch, "trainer", scratch, **kw)
        snaps = RunDir.create(scratch.root / "corun-snapshots", name="bench-corun")
        mark("train-alone.done")
        corun = work2.run(scratch, "corun", snaps, **kw)
    return {"alone": alone[0], "alone_median": alone[1], "corun": corun[0], "corun_median": corun[1]}


def measure_roles(run_dir: RunDir, scratch: RunDir, *, gen_cpus: list[int], train_cpus: list[int], iters: int,
                  warmup: int, timeout_s: float,
                  env: dict[str, dict[str, str]] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """Each role's per-step work in a fresh process pinned like the role in the fully_async layout (same CPUs and
    threads, and ``env[role]``: its GPU): alone, then both at once (see :func:`role_main`).
    ``{"gen"|"train": {"alone"|"corun": phases}}``."""
    procs = {}
    for role, cpus in (("gen", gen_cpus), ("train", train_cpus)):
        env_ = {**os.environ, "OMP_NUM_THREADS": str(len(cpus)), "PYTHONUNBUFFERED": "1", **(env or {}).get(role, {})}
        cmd = [sys.executable, "-m", "relax_hpc.bench.pipeline", "--alone", role, "--run-dir", str(run_dir.root),
               "--scratch", str(scratch.root), "--iters", str(iters), "--warmup-iters", str(warmup),
               "--timeout-s", str(timeout_s)]
        procs[role] = subprocess.Popen(cmd, env=env_, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       preexec_fn=functools.partial(os.sched_setaffinity, 0, set(cpus)))
    deadline = time.monotonic() + timeout_s
    results = {}
    try:
        for role, proc in procs.items():
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if proc.returncode != 0:
                raise RuntimeError(f"measuring the {role} role alone failed (exit {proc.returncode}):\n{err[-3000:]}")
            results[role] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    return results


# ------------------------------------------------------------------------------------------------ main
def default_cores() -> list[int]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"the pipeline benchmark needs 2 CPUs; this process may use only {cores}")
    return cores[:2]


def layout_overrides(mode: str, cores: list[int]) -> list[str]:
    """The resources of each mode: colocate on both cores, fully_async one core per role."""
    if mode == "colocate":
        return ["mode=colocate", "launch.trainer.cpus_per_task=2",
                f"launch.trainer.cpu_affinity=[{cores[0]},{cores[1]}]"]
    return ["mode=fully_async", "rollout.num_workers=1", "launch.trainer.cpus_per_task=1",
            f"launch.trainer.cpu_affinity=[{cores[0]}]", "launch.rollout.cpus_per_task=1",
            f"launch.rollout.cpu_affinity=[{cores[1]}]"]


def compute(colo: ModeRun, asy: ModeRun, roles: dict[str, dict[str, dict[str, float]]], *,
            num_steps: int) -> dict[str, Any]:
    """Every reported figure from the two runs and the roles measured alone and together (:func:`measure_roles`)."""
    gen, train = roles["gen"]["alone"], roles["train"]["alone"]
    wc, wa = timed_window(colo, num_steps), timed_window(asy, num_steps)
    c, a = summarize_colocate(colo, wc), summarize_async(asy, wa)
    t_gen, t_train = gen["generate"], train["train_compute"]
    slow = max(t_gen, t_train)
    steps = wa.num_steps
    last = max(1, min(10, num_steps // 6))
    rc, se_c = final_reward(colo, last)
    ra, se_a = final_reward(asy, last)
    noise = 2.0 * math.sqrt(se_c**2 + se_a**2)  # NaN when a mean is of one step: no verdict
    slower = "trainer" if t_train >= t_gen else "rollout"
    busy = 1.0 - a[f"{slower}_idle_fraction"]
    eff = steps * slow / a["seconds"]
    out: dict[str, Any] = {
        "steps": num_steps, "timed_steps": steps, "timing": TIMING,
        "colocate_seconds": c["seconds"], "fully_async_seconds": a["seconds"],
        "speedup": c["seconds"] / a["seconds"],
        "colocate_step_ms_median": 1000 * wc.median_interval(),
        "fully_async_step_ms_median": 1000 * wa.median_interval(),
        "speedup_median": wc.median_interval() / wa.median_interval(),
        "t_gen": t_gen, "t_train": t_train, "slower_role": slower,
        "ideal_seconds": steps * slow, "ideal_speedup": (t_gen + t_train) / slow, "efficiency_vs_ideal": eff,
        "trainer_idle_fraction": a["trainer_idle_fraction"], "rollout_idle_fraction": a["rollout_idle_fraction"],
        "trainer_wait_fraction": a["trainer_wait_fraction"], "rollout_pause_fraction": a["rollout_pause_fraction"],
        "slower_role_busy_fraction": busy,
        "final_reward_colocate": rc, "final_reward_fully_async": ra,
        "final_reward_stderr_colocate": se_c, "final_reward_stderr_fully_async": se_a, "final_reward_steps": last,
        "samples_per_s_colocate": c["samples"] / c["seconds"], "samples_per_s_fully_async": a["samples"] / a["seconds"],
        "staleness_mean": a["staleness_mean"], "stale_dropped": a["stale_dropped"],
        "fast_path_fraction": a["fast_path_fraction"], "rollout_batches": a["rollout_batches"],
        "targets": {"efficiency_vs_ideal>=0.85": eff >= 0.85, "slower_role_busy>=0.90": busy >= 0.90,
                    "final_reward_within_2se": abs(rc - ra) <= noise if math.isfinite(noise) else None},
        "breakdown": {"colocate": c["breakdown"], "fully_async_trainer": a["breakdown"]["trainer"],
                      "fully_async_rollout": a["breakdown"]["rollout"], "rollout_alone": gen, "trainer_alone": train,
                      "rollout_corun": roles["gen"]["corun"], "trainer_corun": roles["train"]["corun"]},
    }
    # both roles at once: what each role's compute gets when the other CPU is busy too
    out["t_gen_corun"] = roles["gen"]["corun"]["generate"]
    out["t_train_corun"] = roles["train"]["corun"]["train_compute"]
    out["efficiency_vs_corun"] = steps * max(out["t_gen_corun"], out["t_train_corun"]) / a["seconds"]
    # robust to a few disturbed steps: medians of the iterations and of the step intervals
    out["t_gen_median"] = roles["gen"]["alone_median"]["generate"]
    out["t_train_median"] = roles["train"]["alone_median"]["train_compute"]
    out["efficiency_vs_ideal_median"] = max(out["t_gen_median"], out["t_train_median"]) / wa.median_interval()
    return out


def in_run_roles(asy: ModeRun, num_steps: int) -> dict[str, dict[str, dict[str, float]]]:
    """``t_gen`` and ``t_train`` from the fully_async run itself, for layouts a single process cannot stand in
    for (a trainer of several ranks): ``t_train`` = the median ``perf/train_time`` of the timed steps; ``t_gen`` =
    the median generation time of one of rollout-0's batches x the batches of a step / the workers (the pool's
    seconds of generation per step). Both roles ran at once: these are co-run times (no figure alone)."""
    from relax_hpc.roles import load_run_config

    cfg = load_run_config(asy.run_dir)
    w = timed_window(asy, num_steps)
    gens = [metric_value(r["metrics"], "rollout/generate_time") for _, r in clip_cycles(asy.rollout, w)]
    batches = math.ceil(cfg.rollout.prompts_per_step / cfg.rollout.batch_prompts) / cfg.rollout.num_workers
    t_gen = statistics.median(gens) * batches if gens else float("nan")
    t_train = statistics.median(metric_value(r["metrics"], "perf/train_time") for r in w.steps)
    gen, train = {"generate": t_gen}, {"train_compute": t_train}
    return {"gen": {"alone": gen, "alone_median": gen, "corun": gen, "corun_median": gen},
            "train": {"alone": train, "alone_median": train, "corun": train, "corun_median": train}}


def _median_of(records: list[dict[str, Any]], key: str) -> float | None:
    vals = [float(r["metrics"][key]) for r in records if key in r["metrics"]]
    return statistics.median(vals) if vals else None


def handover(run: ModeRun) -> dict[str, Any]:
    """Weight hand-over per version of a fully_async run: the rollout worker's load time by path (the first load,
    at start-up, left out), the trainer's publish time, the fast-path groups' backends (their rendezvous files)."""
    loads = [r for r in sorted(run.rollout, key=lambda r: float(r["time"]))[1:]
             if "rollout/generate_time" in r["metrics"]]
    groups = {}
    folder = run.run_dir.rendezvous
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        with contextlib.suppress(ValueError, OSError):
            info = json.loads(path.read_text())
            if path.stem.startswith("weights-"):  # a fast-path link (weights/fastpath.py link_name)
                groups[path.stem] = info.get("backend")
    return {"load_s_fast_median": _median_of(loads, "perf/update_weights_time_fast"),
            "load_s_files_median": _median_of(loads, "perf/update_weights_time_file"),
            "loads_fast": sum(1 for r in loads if "perf/update_weights_time_fast" in r["metrics"]),
            "loads_files": sum(1 for r in loads if "perf/update_weights_time_file" in r["metrics"]),
            "publish_s_median": _median_of(run.steps[1:], "perf/update_weights_time"),
            "fast_path_backends": groups}


def train_throughput(run: ModeRun, num_steps: int, *, params: int | None, peak_tflops: float) -> dict[str, Any]:
    """Training tokens/s of a mode's trainer (median over the timed steps of ``train/tokens`` x data-parallel
    replicas / ``perf/train_time``) and its MFU over the trainer's GPUs (6 x params x tokens/s / peak / GPUs)."""
    from relax_hpc.roles import load_run_config

    cfg = load_run_config(run.run_dir)
    ranks = cfg.trainer.num_ranks
    meg = cfg.trainer.megatron if cfg.trainer.backend == "megatron" else None  # the torch variant has no layout
    replicas = ranks // (meg.tp * meg.pp) if meg is not None else ranks
    w = timed_window(run, num_steps)
    rates = [metric_value(r["metrics"], "train/tokens") * replicas / metric_value(r["metrics"], "perf/train_time")
             for r in w.steps if metric_value(r["metrics"], "perf/train_time") > 0]
    tps = statistics.median(rates) if rates else float("nan")
    mfu = 6 * params * tps / (peak_tflops * 1e12 * ranks) if params else None
    return {"tokens_per_s": tps, "mfu": mfu, "trainer_ranks": ranks, "replicas": replicas,
            "backend": cfg.trainer.backend, "tp": meg.tp if meg is not None else 1}


def gpu_busy(sampler: GpuSampler, runs: dict[str, ModeRun], num_steps: int,
             layout: GpuLayout | None) -> dict[str, Any]:
    """Each GPU's busy fraction over each mode's timed window, and the trainer / rollout GPUs' means."""
    out: dict[str, Any] = {"sampled": sampler.available, "samples": len(sampler.samples)}
    for mode, run in runs.items():
        w = timed_window(run, num_steps)
        out[mode] = busy = sampler.busy(w.start, w.end)
        if busy and layout is not None and not one_role(mode):
            for role, ids in (("trainer", layout.trainer), ("rollout", layout.rollout)):
                vals = [busy[str(g)] for g in ids if str(g) in busy]
                out[f"fully_async_{role}_mean"] = _mean(vals)
    return out


def disturbed(runs: dict[str, ModeRun], num_steps: int) -> list[str]:
    """Warnings for runs with steps far slower than their median: other load on the machine (a 2-thread colocate
    process suffers most: its threads wait for each other whenever another process takes one of the cores)."""
    out = []
    for mode, run in runs.items():
        w = timed_window(run, num_steps)
        med, worst = w.median_interval(), max(w.intervals())
        if worst > 5 * med:
            slow = sum(x > 5 * med for x in w.intervals())
            out.append(f"{mode}: {slow} step(s) took > 5x the median step ({1000 * worst:.0f} ms vs "
                       f"{1000 * med:.0f} ms): other load on the machine? compare the *_median figures")
    return out


def print_text(res: dict[str, Any]) -> None:
    skip = {"breakdown", "targets", "machine", "layout", "run_dirs", "warnings", "timing", "overrides"}
    print_fields({k: v for k, v in res.items() if k not in skip})
    print(f"{'timing':32s} {res['timing']}")
    for k, v in res["targets"].items():
        print(f"target {k:25s} {'n/a' if v is None else 'met' if v else 'MISSED'}")
    print("\nbreakdown, ms per trainer step (timed steps):")
    for part, phases in res["breakdown"].items():
        print(f"  {part:22s} " + "  ".join(f"{p} {1000 * s:.1f}" for p, s in phases.items()))
    for w in res.get("warnings", []):
        print(f"warning: {w}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relax-hpc bench pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--steps", type=int, default=60, help="trainer steps of each mode (overrides num_steps)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field in both modes (repeatable)")
    p.add_argument("--recipe", default=str(DEMO_RECIPE), help="recipe (default: recipes/demo.yaml)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="trainer.device and rollout.device of both modes (default: cpu, also on a GPU machine)")
    p.add_argument("--gpus", type=int, default=1, help="GPUs to use (default 1: both roles share it). N >= 2: "
                   "colocate with trainer.num_ranks=N (rank r on GPU r); fully_async with the trainer on "
                   "--trainer-gpus and one rollout worker per --rollout-gpus GPU, NCCL fast path. With --device "
                   "cpu the same layout runs on the CPU over gloo (a check of the command, no GPU figures)")
    p.add_argument("--trainer-gpus", default=None, metavar="IDS", help="fully_async trainer GPUs, e.g. 0,1,2,3 "
                   "(default: the first N // 2)")
    p.add_argument("--rollout-gpus", default=None, metavar="IDS", help="fully_async rollout GPUs, one worker each "
                   "(default: the GPUs the trainer does not use)")
    p.add_argument("--shape", default=None, choices=sorted(STEP_SHAPES), help="a Qwen3 shape of bench step "
                   "(random weights, real vocabulary, arithmetic prompts, its batch) instead of --recipe")
    p.add_argument("--cache", default="~/.cache/relax-hpc/bench-step", help="--shape: model folders, tokenizer")
    p.add_argument("--handover-files", action="store_true", help="also a fully_async run with weights.fast_path="
                   "off: the hand-over through the snapshot files, against the fast path")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU for the trainer's "
                   "MFU (H100/H200 SXM: 989; with --shape)")
    p.add_argument("--cores", default=None, help="two CPU ids A,B: trainer on A, rollout on B (default: the first two)")
    p.add_argument("--out", default=None, help="folder for the run dirs (default: a new temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the run dirs (and write result.json beside them)")
    p.add_argument("--alone-iters", type=int, default=20, help="steps of each role measured alone")
    p.add_argument("--timeout-s", type=float, default=1200.0, help="limit for each run")
    # internal: one role's per-step work in a pinned process (see measure_roles)
    p.add_argument("--gpu-query", default="nvidia-smi", help=argparse.SUPPRESS)  # the busy sampler's command
    p.add_argument("--alone", choices=("gen", "train"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
    p.add_argument("--iters", type=int, default=20, help=argparse.SUPPRESS)
    p.add_argument("--warmup-iters", type=int, default=3, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be >= 2 (step 1 is not timed)")
    if a.alone_iters < 1:
        p.error("--alone-iters must be >= 1")
    return a


def _alone_main(a: argparse.Namespace) -> int:
    res = role_main(a.alone, RunDir.open(a.run_dir), RunDir.open(a.scratch), iters=a.iters, warmup=a.warmup_iters,
                    timeout_s=a.timeout_s)
    print(json.dumps(res))
    return 0


def shape_recipe(a: argparse.Namespace, root: Path) -> tuple[Path, int]:
    """``--shape``: bench step's model folder (made once under ``--cache``) and its recipe, written to ``root``;
    (the recipe, the model's parameters)."""
    import yaml

    from relax_hpc.bench import step

    folder = step.model_folder(a.shape, Path(a.cache).expanduser(), a.device)
    rec = step.recipe(folder, step.parse_args(["--shape", a.shape, "--device", a.device]))
    root.mkdir(parents=True, exist_ok=True)
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(rec))
    return path, step.count_params(folder)


def check_inputs(a: argparse.Namespace) -> tuple[list[int], GpuLayout | None]:
    """The CPUs and the GPU layout the arguments name (ValueError: the reason they do not fit)."""
    cores = [int(c) for c in a.cores.split(",")] if a.cores else default_cores()
    if len(cores) != 2 or cores[0] == cores[1]:
        raise ValueError("--cores takes two different CPU ids, e.g. 0,1")
    layout = GpuLayout.parse(a.gpus, a.trainer_gpus, a.rollout_gpus) if a.gpus > 1 else None
    if a.gpus < 1:
        raise ValueError("--gpus must be >= 1")
    return cores, layout


def run_all(a: argparse.Namespace, recipe: Path, common: list[str], cores: list[int], layout: GpuLayout | None,
            dirs: ScratchDirs, params: int | None = None) -> dict[str, Any]:
    """Both modes (and the files-only hand-over run), the roles' own times, every figure."""
    cpus = len(os.sched_getaffinity(0))

    def overrides(mode: str) -> list[str]:
        placed = layout.overrides(mode) + layout.threads(mode, cpus) if layout else layout_overrides(mode, cores)
        return common + placed + a.overrides  # the user's --set last: they win

    res: dict[str, Any] = {
        "benchmark": "pipeline", "recipe": str(recipe), "shape": a.shape, "overrides": common + a.overrides,
        "machine": machine(), "cores": cores, "device": a.device, "gpus": a.gpus,
        "layout": layout.describe() if layout else {
            "colocate": f"1 process on cpus {cores}, 2 threads",
            "fully_async": f"trainer on cpu {cores[0]}, 1 rollout worker on cpu {cores[1]}, 1 thread each"},
        "load_average_before": list(os.getloadavg())}
    sampler = GpuSampler(command=a.gpu_query)
    with sampler:
        runs = {mode: run_mode(recipe, overrides(mode), dirs.new(mode), timeout_s=a.timeout_s)
                for mode in ("colocate", "fully_async")}
        files = (run_mode(recipe, [*overrides("fully_async"), "weights.transport={kind: files}"], dirs.new("files"),
                          timeout_s=a.timeout_s) if a.handover_files else None)
    if layout is None or len(layout.trainer) == 1:
        scratch = RunDir.create(dirs.new("alone"), name="bench-alone")
        env = {r: layout.env(r) for r in ("gen", "train")} if layout else None
        roles = measure_roles(runs["fully_async"].run_dir, scratch, gen_cpus=[cores[1]], train_cpus=[cores[0]],
                              iters=a.alone_iters, warmup=3, timeout_s=a.timeout_s, env=env)
        res["role_times"] = "alone: each role in its own process, measured after the runs"
    else:
        roles = in_run_roles(runs["fully_async"], a.steps)
        res["role_times"] = "in-run: from the fully_async run's own metrics (co-run, a trainer of several ranks)"
    res.update(compute(runs["colocate"], runs["fully_async"], roles, num_steps=a.steps))
    res["gpu_busy"] = gpu_busy(sampler, runs, a.steps, layout)
    res["params"] = params
    res["train_throughput"] = {m: train_throughput(r, a.steps, params=params, peak_tflops=a.peak_tflops)
                               for m, r in runs.items()}
    res["handover"] = {"fast_path_run": handover(runs["fully_async"])}
    if files is not None:
        res["handover"]["files_run"] = handover(files)
        res["handover"]["files_run_seconds"] = timed_window(files, a.steps).seconds
    res["load_average_after"] = list(os.getloadavg())
    res["warnings"] = [f"{m}: the trainer side exited with code {r.exit_code} after logging every step"
                       + ("" if r.finished else " (no 'finished' event)")
                       for m, r in runs.items() if r.exit_code != 0] + disturbed(runs, a.steps)
    if a.keep:
        res["run_dirs"] = {m: str(dirs.root / m) for m in ("colocate", "fully_async", "alone", "files")}
    return res


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.alone:
        return _alone_main(a)
    signal.signal(signal.SIGTERM, interrupt)  # stop our role processes and clean up, as on Ctrl-C
    recipe = Path(a.recipe)
    if not a.shape and not recipe.is_file():
        print(f"error: recipe {recipe} not found (give --recipe)", file=sys.stderr)
        return 2
    try:
        cores, layout = check_inputs(a)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    common = [f"num_steps={a.steps}", f"trainer.device={a.device}", f"rollout.device={a.device}"]
    if a.device == "cuda" and layout is None:  # both roles share one GPU: NCCL refuses two ranks on one device
        common.append("weights.fast_path=gloo")
    dirs = ScratchDirs(a.out, keep=a.keep, prefix="relax-bench-pipeline-")

    def body() -> dict[str, Any]:
        rec, params = shape_recipe(a, dirs.new("recipe")) if a.shape else (recipe, None)
        return run_all(a, rec, common, cores, layout, dirs, params)

    res = run_guarded(body, dirs)
    if isinstance(res, int):
        return res
    return report(res, dirs, as_json=a.json, text=print_text)


if __name__ == "__main__":
    raise SystemExit(main())
