"""Run control without a cluster: local status/cancel on real processes, drain requests, dry runs, sweeps' grid and
result table, resume guards, and the one-line errors when Slurm is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.config.load import config_to_json, validate_dict
from relax_hpc.errors import UserError
from relax_hpc.events import EventLog, Heartbeat
from relax_hpc.fsio import atomic_write_json, read_json
from relax_hpc.launch import slurm_cli
from relax_hpc.launch.resume import resume_ranks, resume_run
from relax_hpc.launch.runctl import cancel_run, format_status, proc_alive, run_status
from relax_hpc.launch.slurm import launch, request_drain, run_finished
from relax_hpc.launch.sweep import combinations, format_sweep_status, label, parse_grid, prepare, sweep_status
from relax_hpc.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]


def make_run(tmp_path: Path, **over: Any) -> tuple[RunDir, Any]:
    data: dict[str, Any] = {"name": "t", "mode": "fully_async", "data": {"task": {"name": "reverse_digits"}},
                            "launch": {"placement": "separate"}, **over}
    cfg = validate_dict(data)
    rd = RunDir.create(tmp_path / "run", name="t")
    atomic_write_json(rd.config, config_to_json(cfg))
    return rd, cfg


def spawn(code: str) -> subprocess.Popen[bytes]:
    """A python process whose command line names relax_hpc (as role processes do)."""
    p = subprocess.Popen([sys.executable, "-c", code, "relax_hpc-role"], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
    return p


def test_local_status_and_cancel(tmp_path: Path) -> None:
    rd, _ = make_run(tmp_path)
    polite = spawn("import time; print('ready', flush=True); time.sleep(120)")
    stubborn = spawn("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', "
                     "flush=True); time.sleep(120)")
    stranger = subprocess.Popen(["sleep", "120"])  # recorded by mistake: not a relax_hpc process
    try:
        atomic_write_json(rd.launch_record, {"executor": "local", "jobs": [], "procs": [
            {"role": "trainer", "rank": 0, "proc": "trainer-0", "pid": polite.pid},
            {"role": "rollout", "rank": 0, "proc": "rollout-0", "pid": stubborn.pid},
            {"role": "rollout", "rank": 1, "proc": "rollout-1", "pid": stranger.pid}]})
        Heartbeat(rd, "trainer", 0).beat(state="running", step=3)
        st = run_status(rd)
        assert [p["alive"] for p in st["procs"]] == [True, True, False]
        assert st["state"] == "running" and st["roles"][0]["step"] == 3 and st["roles"][0]["live"]
        assert "trainer-0" in format_status(st)
        t0 = time.monotonic()
        out = cancel_run(rd, timeout_s=1.0)
        assert sorted(out["signalled_pids"]) == sorted([polite.pid, stubborn.pid])
        assert out["killed_pids"] == [stubborn.pid]
        assert polite.wait(timeout=10) == -15 and stubborn.wait(timeout=10) == -9
        assert time.monotonic() - t0 < 10
        assert stranger.poll() is None  # never signalled
        assert run_status(rd)["state"] == "interrupted"  # cancelled: resumable, not failed
    finally:
        for p in (polite, stubborn, stranger):
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def test_proc_alive_checks_start_time() -> None:
    me = {"pid": os.getpid(), "starttime": 1}
    assert not proc_alive(me)  # same pid, another start time: a reused pid
    assert not proc_alive({"pid": 2 ** 22 + 12345})
    assert not proc_alive({})


def test_request_drain(tmp_path: Path) -> None:
    rd, _ = make_run(tmp_path)
    path = request_drain(rd, "rollout-3")
    assert path == rd.control_file("rollout-3")
    assert read_json(path)["action"] == "drain"


def test_dry_run_renders_writes_and_submits_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no sbatch at all: a dry run must not need it
    rd, cfg = make_run(tmp_path)
    out = launch(rd, cfg, dry_run=True, python="py")
    assert out["dry_run"] and [s["kind"] for s in out["scripts"]] == ["trainer", "rollout_array"]
    assert rd.slurm_script("trainer").read_text() == out["scripts"][0]["text"]
    assert "#SBATCH --array=0-1" in capsys.readouterr().out
    assert not rd.launch_record.exists()


def test_no_slurm_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    rd, cfg = make_run(tmp_path)
    with pytest.raises(UserError) as err:
        launch(rd, cfg, python="py")
    assert "no usable Slurm here (sbatch is not on PATH)" in str(err.value) and "\n" not in str(err.value)
    assert not slurm_cli.slurm_available()


def test_sbatch_error_lines_joined() -> None:
    text = ("sbatch: error: invalid partition specified: nosuch\n"
            "sbatch: error: Batch job submission failed: Invalid partition name specified\n")
    assert slurm_cli._one_line(text, "sbatch") == ("invalid partition specified: nosuch; Batch job submission "
                                                    "failed: Invalid partition name specified")


def test_run_finished_and_resume_guards(tmp_path: Path) -> None:
    rd, _ = make_run(tmp_path)
    atomic_write_json(rd.launch_record, {"executor": "slurm", "jobs": []})
    atomic_write_json(rd.status_file, {"state": "completed"})
    assert run_finished(rd) is True
    with pytest.raises(UserError, match="already completed"):
        resume_run(rd)
    rec = {"jobs": [{"kind": "trainer", "role": "trainer", "ranks": []},
                    {"kind": "rollout_array", "role": "rollout", "ranks": [0, 1]},
                    {"kind": "rollout_array", "role": "rollout", "ranks": [2, 3]}], "retired": [1, 3]}
    assert resume_ranks(rec) == [0, 2]
    assert resume_ranks({"jobs": [{"kind": "colocate", "role": "colocate", "ranks": []}]}) is None


def test_grid_parsing() -> None:
    grid = parse_grid(["algorithm.lr=1e-6,3e-6", "algorithm.clip_high=0.2,0.28"])
    combos = combinations(grid)
    assert combos[0] == ["algorithm.lr=1e-6", "algorithm.clip_high=0.2"] and len(combos) == 4
    assert label(combos[3]) == "lr=3e-6,clip_high=0.28"
    assert label(["data.path=/a b/c"]) == "path=_a_b_c"
    for bad, msg in [(["lr"], "key.path=v1"), (["a=1,", ], "empty value"), (["a=1", "a=2"], "twice"),
                     (["launch.time_min=1,2"], "launch settings"), ([], "at least one")]:
        with pytest.raises(UserError, match=msg):
            parse_grid(bad)


def test_sweep_prepare_validates_every_combination_first(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: s\nmode: colocate\ndata: {task: {name: reverse_digits}}\n")
    with pytest.raises(UserError, match=r"combination 1 \(trainer.lr=-1\)"):
        prepare(recipe, ["trainer.lr=1e-6,-1"], tmp_path / "sw", executor="local", parallel=1)
    assert not (tmp_path / "sw").exists()
    with pytest.raises(UserError, match="mode: colocate"):
        prepare(recipe, ["trainer.lr=1e-6"], tmp_path / "sw2", executor="slurm", parallel=1,
                overrides=["mode=fully_async"])


def test_sweep_status_table(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: s\nmode: colocate\ndata: {task: {name: reverse_digits}}\n")
    sd, manifest, _ = prepare(recipe, ["trainer.lr=1e-6,3e-6"], tmp_path / "sw", executor="local", parallel=2)
    for i, run in enumerate(manifest["runs"]):
        rd = RunDir.create(run["run_dir"])
        with EventLog(rd, "colocate", 0) as log:
            for step in (1, 2, 3):
                log.metrics({"rollout/reward": 0.1 * step + i, "train/loss": 1.0 / step}, step=step)
            log.metrics({"perf/step_time": 0.5}, step=3)  # a later record without a reward
        if i == 0:
            atomic_write_json(rd.status_file, {"state": "completed"})
    atomic_write_json(sd.launch_record, {"executor": "local", "exit_codes": {"0": 0}})
    st = sweep_status(sd.root)
    assert [(r["state"], r["step"], round(r["metrics"]["rollout/reward"], 2)) for r in st["runs"]] == [
        ("completed", 3, 0.3), ("running", 3, 1.3)]
    table = format_sweep_status(st, ["rollout/reward", "train/loss"])
    lines = table.splitlines()
    assert lines[0].split() == ["#", "lr", "state", "step", "rollout/reward", "train/loss"]
    assert lines[1].split() == ["0", "1e-6", "completed", "3", "0.3", "0.3333"]
    res = subprocess.run([sys.executable, "-m", "relax_hpc", "sweep-status", str(sd.root), "--json"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0 and len(json.loads(res.stdout)["runs"]) == 2


def test_cli_user_errors_are_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args in (["status", str(tmp_path)], ["cancel", str(tmp_path / "nope")],
                 ["scale", str(tmp_path), "--rollout", "2"], ["sweep-status", str(tmp_path)]):
        res = subprocess.run([sys.executable, "-m", "relax_hpc", *args], capture_output=True, text=True,
                             timeout=60, env=env)
        assert res.returncode == 2, (args, res.stderr)
        assert res.stderr.startswith("error: ") and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_render_cli_prints_plain_scripts(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: demo\nmode: fully_async\ndata: {task: {name: reverse_digits}}\n")
    res = subprocess.run([sys.executable, "-m", "relax_hpc", "render", str(recipe), "--set",
                          "launch.placement=separate", "--run-dir", str(tmp_path / "my run")],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("#!/bin/bash") == 2 and "role trainer" in res.stdout and "role rollout" in res.stdout
    assert f"--chdir=\"{tmp_path / 'my run'}/slurm\"" in res.stdout
    assert "relax-hpc submit" in res.stderr  # how to create config.json for a hand submission
    bad = subprocess.run([sys.executable, "-m", "relax_hpc", "render", str(recipe), "--set",
                          "launch.trainer.slurm.gress=gpu:1"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert bad.returncode == 2 and "unknown Slurm parameter 'gress'" in bad.stderr and "gres (default" in bad.stderr


@pytest.mark.integration
@pytest.mark.slow
def test_local_sweep_runs_every_combination(tmp_path: Path) -> None:
    """Without Slurm the same grid runs through the local executor, two combinations at a time."""
    sweep_dir = tmp_path / "local sweep"
    args = ["sweep", str(ROOT / "recipes" / "demo.yaml"), "--grid", "trainer.lr=1e-3,3e-3", "--parallel", "2",
            "--sweep-dir", str(sweep_dir), "--executor", "local", "--timeout", "900"]
    for s in ("warmup.steps=0", "rollout.prompts_per_step=4", "rollout.n_samples=4", "rollout.batch_prompts=4",
              "num_steps=2"):
        args += ["--set", s]
    res = subprocess.run([sys.executable, "-m", "relax_hpc", *args], capture_output=True, text=True, timeout=960,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    st = sweep_status(sweep_dir)
    assert [(r["state"], r["step"]) for r in st["runs"]] == [("completed", 2), ("completed", 2)]
    assert all(isinstance(r["metrics"].get("rollout/reward"), float) for r in st["runs"])
    assert "completed" in res.stdout and "1e-3" in res.stdout
    record = read_json(sweep_dir / "launch.json")
    assert record["executor"] == "local" and record["exit_codes"] == {"0": 0, "1": 0}
