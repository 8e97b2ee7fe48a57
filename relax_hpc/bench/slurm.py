"""Slurm benchmark against a real cluster: how long ``submit`` of a whole run and ``status`` of a big run take.

* submit: ``relax-hpc submit`` (a whole CLI process: validate, create the run dir, render, ``sbatch`` each job,
  write launch.json) of a fully_async run in placement separate (a trainer job + a rollout array) and in hetjob.
  The jobs run ``/bin/true`` as their interpreter (``RELAX_HPC_PYTHON``), so they end at once; also timed
  in-process (``launch()`` alone).
* status: a run dir recording 64 rollout jobs (the tasks of one held 64-task array, recorded as 64 separate job
  ids) and 64 heartbeats; ``relax-hpc status RUN_DIR --json`` as a whole CLI process, and ``run_status()``
  in-process. Each status is ONE squeue + ONE sacct call.

Every job submitted here is cancelled by id at the end. ``python -m relax_hpc.bench.slurm [--json] [--repeat N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from relax_hpc.events import Heartbeat
from relax_hpc.fsio import atomic_write_json, read_json
from relax_hpc.launch import slurm_cli
from relax_hpc.rundir import RunDir

RECIPE = """name: bench
mode: fully_async
num_steps: 10
data: {task: {name: reverse_digits}}
rollout: {num_workers: 4}
launch: {time_min: 5, signal_delay_s: 30}
"""


def use_local_cluster() -> None:
    """When SLURM_CONF is unset, point it at the cluster of tools/slurm_local.sh (``$RELAX_SLURM_ENV``, else
    ``/tmp/relax-slurm/slurm.env``), as ``source slurm.env`` would. Nothing changes when the file is missing."""
    if "SLURM_CONF" in os.environ:
        return
    env_file = Path(os.environ.get("RELAX_SLURM_ENV", "/tmp/relax-slurm/slurm.env"))
    try:
        lines = env_file.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        if line.startswith("export SLURM_CONF="):
            os.environ["SLURM_CONF"] = line.split("=", 1)[1].strip()


def held_array(n: int) -> str:
    """Submit a held ``n``-task array of trivial jobs (they never run); returns its id. Cancel it by id."""
    res = slurm_cli.run_slurm(["sbatch", "--parsable", "--hold", f"--array=0-{n - 1}", "--job-name=relax-bench",
                          "--output=/dev/null", "--time=5", "--wrap", "sleep 1"])
    if res.returncode != 0:
        raise RuntimeError(f"sbatch failed: {res.stderr.strip()}")
    return res.stdout.strip().split(";")[0]


def status_fixture(rd: RunDir, array_id: str, n: int) -> None:
    """Record ``n`` rollout jobs (one id per array task) in launch.json and write one heartbeat per worker."""
    if not rd.config.is_file():
        atomic_write_json(rd.config, {"name": "bench", "mode": "fully_async", "monitor": {"dead_after_s": 120}})
    jobs = [{"job_id": f"{array_id}_{i}", "kind": "rollout_array", "role": "rollout", "roles": ["rollout"],
             "ranks": [i], "script": ""} for i in range(n)]
    atomic_write_json(rd.launch_record, {"executor": "slurm", "mode": "fully_async", "placement": "separate",
                                         "submitted": time.time(), "jobs": jobs, "retired": [], "history": []})
    for i in range(n):
        Heartbeat(rd, "rollout", i).beat(state="running", step=i, version=i)


def _cli(args: list[str], env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "relax_hpc", *args], capture_output=True, text=True, timeout=120,
                         env=env)
    return time.perf_counter() - t0, res


def _env() -> dict[str, str]:
    from relax_hpc.launch.sbatch import default_pythonpath

    env = dict(os.environ)
    src = default_pythonpath()
    if src:
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["RELAX_HPC_PYTHON"] = "/bin/true"  # the jobs end at once: this measures submission only
    return env


def bench_submit(tmp: Path, repeat: int, submitted: list[str]) -> dict[str, Any]:
    from relax_hpc.config.load import config_to_json, load_recipe
    from relax_hpc.launch.slurm import launch

    recipe = tmp / "bench.yaml"
    recipe.write_text(RECIPE)
    env = _env()
    out: dict[str, Any] = {}
    for placement in ("separate", "hetjob"):
        times = []
        for i in range(repeat):
            rd = tmp / f"submit-{placement}-{i}"
            took, res = _cli(["submit", str(recipe), "--executor", "slurm", "--run-dir", str(rd),
                              "--set", f"launch.placement={placement}"], env)
            if res.returncode != 0:
                raise RuntimeError(f"submit failed: {res.stderr.strip()}")
            submitted += [j["job_id"] for j in read_json(RunDir(rd).launch_record)["jobs"]]
            times.append(took)
        out[f"submit_cli_{placement}_s"] = statistics.median(times)
        cfg = load_recipe(recipe, [f"launch.placement={placement}"])
        times = []
        for i in range(repeat):
            rd = RunDir.create(tmp / f"launch-{placement}-{i}")
            atomic_write_json(rd.config, config_to_json(cfg))
            t0 = time.perf_counter()
            rec = launch(rd, cfg, python="/bin/true")
            times.append(time.perf_counter() - t0)
            submitted += [j["job_id"] for j in rec["jobs"]]
        out[f"launch_inprocess_{placement}_s"] = statistics.median(times)
    return out


def bench_status(tmp: Path, repeat: int, submitted: list[str], n: int = 64) -> dict[str, Any]:
    from relax_hpc.launch.runctl import run_status

    array_id = held_array(n)
    submitted.append(array_id)
    rd = RunDir.create(tmp / "status-run")
    status_fixture(rd, array_id, n)
    env = _env()
    _cli(["status", str(rd.root), "--json"], env)  # warm-up
    cli_times, inproc = [], []
    for _ in range(repeat):
        took, res = _cli(["status", str(rd.root), "--json"], env)
        if res.returncode != 0:
            raise RuntimeError(f"status failed: {res.stderr.strip()}")
        rows = sum(len(j["states"]) for j in json.loads(res.stdout)["jobs"])
        cli_times.append(took)
        t0 = time.perf_counter()
        run_status(rd)
        inproc.append(time.perf_counter() - t0)
    return {"status_jobs": n, "status_rows": rows, "status_cli_s": statistics.median(cli_times),
            "status_inprocess_s": statistics.median(inproc)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="relax-hpc bench slurm", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--repeat", type=int, default=5, help="measurements per figure (the median is reported)")
    args = p.parse_args(argv)
    use_local_cluster()
    problem = slurm_cli.slurm_problem()
    if problem:
        print(f"error: no Slurm to measure ({problem}); start one with tools/slurm_local.sh start", file=sys.stderr)
        return 2
    submitted: list[str] = []
    with tempfile.TemporaryDirectory(prefix="relax-bench-slurm-") as tmp:
        try:
            figures = {**bench_submit(Path(tmp), args.repeat, submitted),
                       **bench_status(Path(tmp), args.repeat, submitted)}
        finally:
            slurm_cli.scancel(submitted)
    figures["targets"] = {"submit_cli_s": 2.0, "status_cli_s": 1.0}
    if args.json:
        print(json.dumps(figures, indent=1))
    else:
        for k, v in figures.items():
            if isinstance(v, float):
                print(f"{k:<32} {v * 1000:8.0f} ms")
        print(f"(targets: submit < 2 s, status of {figures['status_jobs']} rollout jobs < 1 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
