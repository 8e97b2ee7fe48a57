"""``relax-hpc bench pipeline``: the JSON report is complete and self-consistent (not the speed targets: those are
benchmark figures, measured on a quiet machine and written down in docs/benchmarks.md), and per-role CPU pinning."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
from runutil import cli

from relax_hpc.bench.pipeline import layout_overrides
from relax_hpc.config.load import load_recipe
from relax_hpc.errors import ConfigError, UserError

REQUIRED = [
    "colocate_seconds", "fully_async_seconds", "speedup", "ideal_speedup", "efficiency_vs_ideal",
    "trainer_idle_fraction", "rollout_idle_fraction", "final_reward_colocate", "final_reward_fully_async",
    "samples_per_s_colocate", "samples_per_s_fully_async", "t_gen", "t_train", "timed_steps", "staleness_mean",
    "rollout_pause_fraction", "trainer_wait_fraction", "slower_role", "slower_role_busy_fraction", "breakdown",
    "timing", "load_average_before", "load_average_after", "t_gen_corun", "t_train_corun", "targets",
]
FRACTIONS = ["trainer_idle_fraction", "rollout_idle_fraction", "trainer_wait_fraction", "rollout_pause_fraction",
             "slower_role_busy_fraction"]

two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the layout needs two CPUs")


@pytest.mark.integration
@pytest.mark.slow
@two_cpus
def test_bench_pipeline_json(tmp_path):
    steps = 4
    out = tmp_path / "out"
    r = cli("bench", "pipeline", "--json", "--steps", str(steps), "--alone-iters", "2", "--keep", "--out", str(out),
            "--set", "warmup.steps=2", "--set", "rollout.prompts_per_step=4", "--set", "rollout.batch_prompts=4",
            "--set", "rollout.n_samples=4", timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert not [k for k in REQUIRED if k not in res]
    assert res["timed_steps"] == steps - 1
    # the figures are what their definitions say, recomputed from the reported parts
    slow = max(res["t_gen"], res["t_train"])
    assert res["efficiency_vs_ideal"] == pytest.approx(res["timed_steps"] * slow / res["fully_async_seconds"])
    assert res["ideal_speedup"] == pytest.approx((res["t_gen"] + res["t_train"]) / slow)
    assert 1.0 <= res["ideal_speedup"] <= 2.0
    assert res["speedup"] == pytest.approx(res["colocate_seconds"] / res["fully_async_seconds"])
    assert res["efficiency_vs_corun"] == pytest.approx(
        res["timed_steps"] * max(res["t_gen_corun"], res["t_train_corun"]) / res["fully_async_seconds"])
    assert res["efficiency_vs_ideal_median"] == pytest.approx(
        1000 * max(res["t_gen_median"], res["t_train_median"]) / res["fully_async_step_ms_median"])
    assert res["slower_role"] == ("trainer" if res["t_train"] >= res["t_gen"] else "rollout")
    idle = res["trainer_idle_fraction"] if res["slower_role"] == "trainer" else res["rollout_idle_fraction"]
    assert res["slower_role_busy_fraction"] == pytest.approx(1.0 - idle)
    for k in FRACTIONS:
        assert 0.0 <= res[k] <= 1.0, k
    assert res["trainer_wait_fraction"] <= res["trainer_idle_fraction"] + 1e-9  # waiting is part of idle
    assert res["rollout_pause_fraction"] <= res["rollout_idle_fraction"] + 1e-9
    for k in ("colocate_seconds", "fully_async_seconds", "t_gen", "t_train", "samples_per_s_colocate",
              "samples_per_s_fully_async"):
        assert res[k] > 0, k
    for k in ("final_reward_colocate", "final_reward_fully_async"):
        assert 0.0 <= res[k] <= 1.0, k  # digits_positional scores in [0, 1]
    assert 0.0 <= res["staleness_mean"] <= 1.0  # the demo allows one version of lag
    # the breakdown adds up: the trainer's phases and waits are the wall time of the timed steps
    tr = res["breakdown"]["fully_async_trainer"]
    assert sum(tr.values()) * res["timed_steps"] == pytest.approx(res["fully_async_seconds"], rel=1e-6)
    ro = res["breakdown"]["fully_async_rollout"]
    assert sum(ro.values()) * res["timed_steps"] == pytest.approx(res["fully_async_seconds"], rel=1e-6)
    co = res["breakdown"]["colocate"]
    assert sum(co.values()) * res["timed_steps"] == pytest.approx(res["colocate_seconds"], rel=1e-6)
    assert res["breakdown"]["rollout_alone"]["generate"] == res["t_gen"]
    assert res["breakdown"]["trainer_alone"]["train_compute"] == res["t_train"]
    assert all(math.isfinite(v) for part in res["breakdown"].values() for v in part.values())
    # the layout was applied: each fully_async role ran pinned to its own CPU, colocate on both
    cores = res["cores"]
    cfg = json.loads((out / "fully_async" / "config.json").read_text())
    assert cfg["launch"]["trainer"]["cpu_affinity"] == [cores[0]]
    assert cfg["launch"]["rollout"]["cpu_affinity"] == [cores[1]]
    assert cfg["rollout"]["num_workers"] == 1 and cfg["num_steps"] == steps
    colo = json.loads((out / "colocate" / "config.json").read_text())
    assert colo["mode"] == "colocate" and colo["launch"]["trainer"]["cpu_affinity"] == cores
    assert json.loads((out / "result.json").read_text())["fully_async_seconds"] == res["fully_async_seconds"]


def _steps(times: list[float], **metrics: float) -> list[dict]:
    return [{"time": t, "step": i + 1, "kind": "metrics", "metrics": {"perf/step_time": 0.4, **metrics}}
            for i, t in enumerate(times)]


def test_compute_on_synthetic_runs(tmp_path):
    """The figures from known metric lines: windows, clipping of rollout cycles at the window's edges, ratios."""
    from relax_hpc.bench.pipeline import ModeRun, compute
    from relax_hpc.rundir import RunDir

    rd = RunDir(tmp_path)
    colo = ModeRun("colocate", rd, 0, _steps([10.0, 11.0, 12.0, 13.0], **{
        "perf/rollout_time": 0.3, "perf/train_time": 0.5, "rollout/reward": 0.5, "train/samples": 128}))
    asy = ModeRun("fully_async", rd, 0, _steps([20.0, 20.5, 21.0, 21.5], **{
        "perf/train_wait_time": 0.1, "perf/store_plan_time": 0.02, "perf/train_time": 0.3, "rollout/reward": 0.5,
        "train/samples": 128, "rollout/staleness_mean": 1.0}))
    # rollout cycles of 0.5 s ending at 19.75, 20.25, ..., 21.75: each 0.4 s busy + 0.1 s paused
    asy.rollout = [{"time": 19.75 + 0.5 * k, "kind": "metrics",
                    "metrics": {"rollout/generate_time": 0.4, "perf/rollout_pause_time": 0.1}} for k in range(5)]
    phases = {"generate": 0.25, "reward": 0.0, "store_write": 0.0, "weight_load": 0.0}
    roles = {"gen": {"alone": phases, "alone_median": phases, "corun": {**phases, "generate": 0.3}},
             "train": {"alone": {"train_compute": 0.4}, "alone_median": {"train_compute": 0.4},
                       "corun": {"train_compute": 0.45}}}
    res = compute(colo, asy, roles, num_steps=4)
    assert res["timed_steps"] == 3
    assert res["colocate_seconds"] == pytest.approx(3.0) and res["fully_async_seconds"] == pytest.approx(1.5)
    assert res["speedup"] == pytest.approx(2.0) and res["speedup_median"] == pytest.approx(2.0)
    assert res["slower_role"] == "trainer" and res["ideal_speedup"] == pytest.approx(0.65 / 0.4)
    assert res["efficiency_vs_ideal"] == pytest.approx(3 * 0.4 / 1.5)
    assert res["efficiency_vs_corun"] == pytest.approx(3 * 0.45 / 1.5)
    assert res["efficiency_vs_ideal_median"] == pytest.approx(0.4 / 0.5)
    assert res["trainer_wait_fraction"] == pytest.approx(3 * 0.08 / 1.5)
    assert res["trainer_idle_fraction"] == pytest.approx(1 - 3 * (0.02 + 0.3) / 1.5)
    # the window [20.0, 21.5] holds three whole cycles: the ones ending at 20.25 and 21.75 count half each
    assert res["rollout_batches"] == pytest.approx(3.0)
    assert res["rollout_pause_fraction"] == pytest.approx(0.2)
    assert res["rollout_idle_fraction"] == pytest.approx(0.2)
    assert res["samples_per_s_fully_async"] == pytest.approx(3 * 128 / 1.5)
    assert res["final_reward_colocate"] == res["final_reward_fully_async"] == 0.5
    assert res["targets"]["final_reward_within_2se"] is None  # a mean over one step has no standard error


def test_bench_pipeline_rejects_bad_arguments(tmp_path):
    r = cli("bench", "pipeline", "--steps", "1", timeout=60)
    assert r.returncode != 0 and "--steps must be >= 2" in r.stderr
    r = cli("bench", "pipeline", "--cores", "0,0", timeout=60)
    assert r.returncode == 2 and "two different CPU ids" in r.stderr
    r = cli("bench", "pipeline", "--recipe", str(tmp_path / "missing.yaml"), timeout=60)
    assert r.returncode == 2 and "not found" in r.stderr


def test_layout_overrides_validate():
    from runutil import DEMO

    colo = load_recipe(DEMO, layout_overrides("colocate", [0, 1]))
    assert colo.mode == "colocate" and colo.launch.trainer.cpu_affinity == [0, 1]
    assert colo.launch.trainer.cpus_per_task == 2
    asy = load_recipe(DEMO, layout_overrides("fully_async", [0, 1]))
    assert asy.rollout.num_workers == 1
    assert (asy.launch.trainer.cpu_affinity, asy.launch.rollout.cpu_affinity) == ([0], [1])
    assert asy.launch.trainer.cpus_per_task == asy.launch.rollout.cpus_per_task == 1
    with pytest.raises(ConfigError):
        load_recipe(DEMO, ["launch.trainer.cpu_affinity=[]"])
    with pytest.raises(ConfigError):
        load_recipe(DEMO, ["launch.rollout.cpu_affinity=[-1]"])


@two_cpus
def test_local_executor_pins_a_role(tmp_path):
    """``cpu_affinity`` reaches the child before it runs: the process reports exactly that mask."""
    import subprocess

    from relax_hpc.launch.local import _pin

    cpu = sorted(os.sched_getaffinity(0))[-1]
    proc = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                          capture_output=True, text=True, timeout=60, preexec_fn=_pin([cpu]))
    assert proc.stdout.strip() == str([cpu])
    assert _pin(None) is None
    with pytest.raises(UserError, match="not available"):
        _pin([max(os.sched_getaffinity(0)) + 1000])
