"""How a run ends, as a new user sees it: Ctrl-C, SIGTERM and ``relax-hpc cancel`` end a local run as
``interrupted`` (exit message and ``status``), not ``failed``; ``resume`` says the step and checkpoint it resumes
from and shows no warm-up it did not run; ``submit --executor slurm --dry-run`` renders the scripts with no Slurm
installed. Real runs of the demo recipe, shortened."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax_hpc.launch.local import pid_alive

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "recipes" / "demo.yaml"
SHORT = ["--set", "num_steps=8", "--set", "warmup.steps=2", "--set", "rollout.prompts_per_step=2",
         "--set", "rollout.batch_prompts=2", "--set", "rollout.n_samples=2", "--set", "trainer.checkpoint_every=1",
         "--set", "trainer.async_checkpoint=false"]


def env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def cli(*argv: str, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relax_hpc", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env(**extra), timeout=timeout)


def start(run: Path, *more: str) -> subprocess.Popen[str]:
    """The launcher as a terminal starts it: SIGINT at its default (a non-interactive shell's background job, as a
    CI runner may start the suite, passes SIGINT on ignored, and Ctrl-C would then be ignored, as Unix intends)."""
    return subprocess.Popen([sys.executable, "-m", "relax_hpc", "submit", str(DEMO), "--executor", "local",
                             "--run-dir", str(run), *SHORT, *more], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_checkpoint(run: Path, proc: subprocess.Popen[str] | None, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not any((run / "checkpoints").glob("step_*")):
        assert proc is None or proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.2)


def status_state(run: Path) -> str:
    res = cli("status", str(run))
    assert res.returncode == 0, res.stderr
    m = re.search(r"^state: (\S+)", res.stdout, re.M)
    assert m, res.stdout
    return m.group(1)


@pytest.mark.integration
@pytest.mark.parametrize("sigs", [[signal.SIGINT], [signal.SIGTERM], [signal.SIGTERM, signal.SIGINT]],
                         ids=["SIGINT", "SIGTERM", "SIGTERM-then-SIGINT"])
def test_signal_to_the_launcher_ends_the_run_interrupted_and_resume_says_where(tmp_path: Path,
                                                                              sigs: list[int]) -> None:
    """Ctrl-C (the launcher; the roles checkpoint on the launcher's SIGTERM), a kill, or a kill then an impatient
    Ctrl-C while the roles checkpoint (the roles are stopped at once): the run ends interrupted, and the launcher
    exits only after every role it started."""
    run = tmp_path / "run"
    # a run that cannot end before the signal (short runs of 0.04 s steps did on a loaded machine: exit 0, not 130)
    proc = start(run, "--set", "num_steps=100000")
    wait_for_checkpoint(run, proc)
    for i, sig in enumerate(sigs):
        if i:
            time.sleep(0.3)
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    assert "run interrupted" in err and f"relax-hpc resume {run}" in err and "run failed" not in err, err
    pids = [p["pid"] for p in json.loads((run / "launch.json").read_text())["procs"]]
    assert pids and not [p for p in pids if pid_alive(p)]  # no role outlives the launcher
    if "interrupted again" in err:  # the second signal came while the roles checkpointed (it nearly always does)
        assert "stopped before their checkpoint was done" in err, err
    assert json.loads((run / "STATUS.json").read_text())["state"] == "interrupted"
    assert status_state(run) == "interrupted"
    if sigs != [signal.SIGINT]:
        return
    config = json.loads((run / "config.json").read_text())  # resumed, the run ends 3 steps after its checkpoint
    config["num_steps"] = max(int(p.name.split("_")[-1]) for p in (run / "checkpoints").glob("step_*")) + 3
    (run / "config.json").write_text(json.dumps(config))
    res = cli("resume", str(run), timeout=300)
    assert res.returncode == 0, res.stderr
    m = re.search(r"resuming from step (\d+) \(checkpoint (\S+)\)", res.stdout)
    assert m and Path(m.group(2)).name == f"step_{int(m.group(1)):08d}", res.stdout
    assert int(m.group(1)) >= 1
    assert "warm-up" not in res.stdout + res.stderr  # the resumed trainer runs no warm-up and says none
    assert "run completed" in res.stdout and status_state(run) == "completed"


@pytest.mark.integration
def test_cancel_of_a_detached_run_is_interrupted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "relax_hpc", "submit", str(DEMO), "--executor", "local",
                          "--run-dir", str(run), *SHORT, "--set", "num_steps=200", "--detach"],
                         capture_output=True, text=True, cwd=ROOT, env=env(), timeout=120)
    assert res.returncode == 0, res.stderr
    try:
        wait_for_checkpoint(run, None)
    finally:
        cancel = cli("cancel", str(run), "--timeout", "60")
    assert cancel.returncode == 0 and "sent SIGTERM" in cancel.stdout, cancel.stderr
    assert status_state(run) == "interrupted"


def test_dry_run_renders_without_slurm(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()  # a PATH with no sbatch (nor anything else)
    recipe = ROOT / "recipes" / "qwen3-4b-math-fully-async.yaml"
    res = cli("submit", str(recipe), "--executor", "slurm", "--dry-run", "--run-dir", str(tmp_path / "run"),
              PATH=str(empty))
    assert res.returncode == 0, res.stderr
    assert "#SBATCH" in res.stdout and "not submitted" in res.stdout
    assert (tmp_path / "run" / "config.json").is_file() and (tmp_path / "run" / "slurm" / "hetjob.sbatch").is_file()
    assert "warning: cannot run on this machine" in res.stderr  # the data is not here: said, not refused
    rendered = cli("render", str(recipe), "--run-dir", str(tmp_path / "r2"), PATH=str(empty))
    assert rendered.returncode == 0 and "#SBATCH" in rendered.stdout
    assert "no Slurm needed" in rendered.stderr
    # a real submit still needs Slurm: one line
    real = cli("submit", str(recipe), "--executor", "slurm", "--run-dir", str(tmp_path / "r3"), PATH=str(empty))
    assert real.returncode == 2 and "sbatch is not on PATH" in real.stderr
