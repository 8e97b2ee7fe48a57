"""``relax-hpc bench pipeline``: the JSON report is complete and self-consistent (not the speed targets: those are
benchmark figures, measured on a quiet machine and written down in docs/benchmarks.md), and per-role CPU pinning."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from relax_hpc.bench.pipeline import layout_overrides
from relax_hpc.config.load import load_recipe
from relax_hpc.errors import ConfigError, UserError
from tests.helpers.runutil import cli

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
    from tests.helpers.runutil import DEMO

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


def test_gpu_layouts_validate():
    """``--gpus``: colocate on every GPU, fully_async split trainer / one worker per rollout GPU; bad lists refused."""
    from relax_hpc.bench.gpus import GpuLayout
    from tests.helpers.runutil import DEMO

    two = GpuLayout.parse(2, None, None)
    assert (two.trainer, two.rollout) == ((0,), (1,))
    colo = load_recipe(DEMO, two.overrides("colocate"))
    assert colo.mode == "colocate" and colo.trainer.num_ranks == 2 and colo.launch.trainer.gpus == [0, 1]
    asy = load_recipe(DEMO, two.overrides("fully_async"))
    assert (asy.launch.trainer.gpus, asy.launch.rollout.gpus, asy.rollout.num_workers) == ([0], [1], 1)
    assert asy.weights.fast_path == "auto"  # NCCL between the two GPUs
    eight = GpuLayout.parse(8, None, None)
    asy8 = load_recipe(DEMO, eight.overrides("fully_async") + eight.threads("fully_async", 128))
    assert asy8.trainer.num_ranks == 4 and asy8.launch.trainer.gpus == [0, 1, 2, 3]
    assert asy8.rollout.num_workers == 4 and asy8.launch.rollout.gpus == [4, 5, 6, 7]
    assert asy8.launch.trainer.cpus_per_task == asy8.launch.rollout.cpus_per_task == 16
    # a TP=2 trainer on both GPUs of two, its worker beside rank 1: NCCL from rank 0 (GPU 0) still works
    shared = GpuLayout.parse(2, "0,1", "1")
    assert "weights.fast_path=auto" in shared.overrides("fully_async")
    assert "weights.fast_path=gloo" in GpuLayout.parse(2, "0", "0").overrides("fully_async")
    for args, msg in (((1, None, None), ">= 2"), ((2, "0,2", None), "outside"), ((2, "0,0", "1"), "repeat"),
                      ((2, "0,1", None), "both name"), ((2, "a", None), "ids separated")):
        with pytest.raises(ValueError, match=msg):
            GpuLayout.parse(*args)
    with pytest.raises(ConfigError):
        load_recipe(DEMO, ["launch.rollout.gpus=[]"])


def test_local_executor_gpu_env_per_rank():
    """``launch.<role>.gpus``: each rank's own GPU first in CUDA_VISIBLE_DEVICES, every other GPU after it."""
    from relax_hpc.launch.local import gpu_env
    from tests.helpers.runutil import DEMO

    cfg = load_recipe(DEMO, ["mode=fully_async", "launch.trainer.gpus=[0,1,2,3]", "launch.rollout.gpus=[4,5,6,7]"])
    assert gpu_env(cfg, cfg.launch.rollout.gpus, 2) == {"CUDA_VISIBLE_DEVICES": "6,0,1,2,3,4,5,7", "RELAX_HPC_GPU": "6"}
    assert gpu_env(cfg, cfg.launch.trainer.gpus, 0)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert gpu_env(cfg, cfg.launch.rollout.gpus, 5)["RELAX_HPC_GPU"] == "5"  # ranks beyond the list wrap around
    assert gpu_env(cfg, None, 0) == {}


def test_gpu_sampler_with_a_stand_in_nvidia_smi(tmp_path):
    """The busy sampler parses ``nvidia-smi`` CSV and averages per GPU inside a window. This machine has no GPU:
    a shell script stands in for ``nvidia-smi`` (the real one is used on GPU machines, see tools/gpu/x2.sh)."""
    import time

    from relax_hpc.bench.gpus import GpuSampler, parse_query

    assert parse_query("0, 40\n1, [N/A]\nbad\n2, 7") == {0: 40.0, 2: 7.0}
    fake = tmp_path / "nvidia-smi"
    fake.write_text('#!/bin/sh\n[ "$1" = "--query-gpu=index,utilization.gpu" ] || exit 3\nprintf "0, 40\\n1, 90\\n"\n')
    fake.chmod(0o755)
    start = time.time()
    with GpuSampler(period_s=0.05, command=str(fake)) as s:
        assert s.available
        deadline = time.monotonic() + 30
        while len(s.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(s.samples) >= 3
    assert s.busy(start, time.time()) == {"0": pytest.approx(0.4), "1": pytest.approx(0.9)}
    assert s.busy(0.0, 1.0) is None  # no sample in that window
    missing = GpuSampler(command=str(tmp_path / "absent"))
    with missing:
        pass
    assert not missing.available and missing.samples == []


@pytest.mark.integration
@pytest.mark.slow
def test_bench_pipeline_two_trainer_ranks_with_the_fast_path(tmp_path):
    """``--gpus 2 --trainer-gpus 0,1``, on the CPU (gloo): fully_async with a trainer of two FSDP2 ranks and the
    fast path to its worker (the start-up weight gather is a collective of every trainer rank: it once deadlocked),
    colocate with two ranks; t_gen / t_train then come from the fully_async run itself."""
    out = tmp_path / "out"
    r = cli("bench", "pipeline", "--json", "--device", "cpu", "--steps", "2", "--gpus", "2", "--trainer-gpus", "0,1",
            "--rollout-gpus", "1", "--shape", "qwen3-tiny", "--cache", str(tmp_path / "cache"), "--keep", "--out",
            str(out), "--timeout-s", "240", "--set", "rollout.prompts_per_step=2", "--set", "rollout.batch_prompts=2",
            "--set", "rollout.n_samples=2", "--set", "rollout.sampling.max_new_tokens=4", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["role_times"].startswith("in-run") and res["t_train"] > 0 and res["t_gen"] > 0
    cfg = json.loads((out / "fully_async" / "config.json").read_text())
    assert cfg["trainer"]["num_ranks"] == 2 and cfg["launch"]["trainer"]["gpus"] == [0, 1]
    assert cfg["weights"]["fast_path"] == "auto"
    assert res["handover"]["fast_path_run"]["fast_path_backends"] == {"weights-0": "gloo"}
    assert res["train_throughput"]["fully_async"]["trainer_ranks"] == 2
    assert res["train_throughput"]["colocate"]["tokens_per_s"] > 0
