"""What the README and docs/cluster.md tell a new user stays true.

* The README's demo table is the stored figures of ``bash tools/demo.sh`` (``tests/unit/golden/demo_figures.json``,
written
  by ``tools/demo_figures.py --write`` from the demo's run dirs), and the code still produces those figures: a short
  run of the demo reproduces the stored first rewards exactly (the colocate series is deterministic: two runs with
  the same seed give the same reward and loss at every step, and a shorter run is a prefix of a longer one, as the
  learning rate is constant). A change that moves the demo's trajectory fails here until the figures are measured
  again.
* Every command a user can copy from the README's and docs/cluster.md's ``bash`` blocks is either run here (as
  written, with overrides appended that shorten runs) or listed with the reason it cannot run on a CPU test machine.
* The README lists every shipped recipe, and every recipe validates for Slurm on this machine.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CLUSTER = ROOT / "docs" / "cluster.md"
GOLDEN = ROOT / "tests" / "unit" / "golden" / "demo_figures.json"
from tools import demo_figures  # noqa: E402  (tools/ as a namespace package, the repository root on the path)

SHORT = ["--set", "num_steps=3", "--set", "warmup.steps=0", "--set", "rollout.prompts_per_step=2",
         "--set", "rollout.batch_prompts=2", "--set", "rollout.n_samples=2"]
"""Appended to the README's submit commands: the same command, a run of seconds."""

NOT_RUN = {
    'pip install -e ".[train,monitor]"': "an install (CI runs tools/install.sh through tools/test.sh)",
    "bash tools/demo.sh": "the whole 800-step demo; its figures are checked against a short run below",
    "bash tools/test.sh": "the test suite itself (CI's .ci/run)",
    "bash tools/test.sh tests/unit": "the test suite itself (one tier of it)",
    "bash tools/test.sh --proofs": "the test suite itself (its long runs, not in CI)",
    "python -m pytest tests/unit -x -q": "the test suite itself (one tier of it)",
    "ruff check .": "CI's lint (ruff check relax_hpc tests tools)",
    "relax-hpc bench store --json": "a benchmark; tests/unit/test_store_bench.py runs it at small sizes",
    "git clone <this repository> relax-hpc && cd relax-hpc": "network",
    "python3 -m venv /shared/envs/relax && source /shared/envs/relax/bin/activate": "a cluster's shared folder",
    "pip install torch --index-url https://download.pytorch.org/whl/cu128": "network, CUDA",
    'pip install -e ".[train,monitor]" (cluster)': "an install",
    "pip install datasets huggingface_hub": "network",
    "huggingface-cli download Qwen/Qwen3-4B --local-dir /shared/models/Qwen3-4B": "network",
    "relax-hpc data make math --out /shared/data/math": "network (the hub); its offline error is tested below",
    "relax-hpc monitor runs/qwen3-4b-try": "a live view of a cluster run; `monitor --once` runs below on a CPU run",
    "relax-hpc status runs/qwen3-4b-try": "a cluster run; `status` runs below on a CPU run",
    "relax-hpc plot runs/qwen3-4b-try -o curves.png": "a cluster run; `plot` runs below on a CPU run",
    "relax-hpc cancel runs/qwen3-4b-try": "a cluster run; `cancel` runs below on a CPU run",
    "relax-hpc resume runs/qwen3-4b-try": "a cluster run; `resume` runs below on a CPU run",
}
"""Commands of the docs not run here, and why."""


def bash_commands(path: Path) -> list[str]:
    """The command lines of a markdown file's ``bash`` blocks (comments cut; ``--set`` fragments skipped)."""
    out, inside = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if inside:
            cmd = re.sub(r"\s+#.*$", "", line).strip()
            if cmd and not cmd.startswith(("#", "--set")):
                out.append(cmd)
    return out


# ------------------------------------------------------------------------------------------------ demo figures
def test_readme_demo_table_is_the_stored_figures() -> None:
    fig = json.loads(GOLDEN.read_text())
    assert demo_figures.readme_table(README.read_text()) == demo_figures.table(fig)
    assert fig["colocate"]["last_50"] >= 0.8 and fig["fully_async"]["last_50"] >= 0.8  # what the README says


def test_the_table_check_can_fail() -> None:
    fig = json.loads(GOLDEN.read_text())
    fig["colocate"]["last_50"] += 0.05
    assert demo_figures.readme_table(README.read_text()) != demo_figures.table(fig)


DEMO_THREADS = {"OMP_NUM_THREADS": "2"}
"""The threads of ``bash tools/demo.sh`` on a machine of 2 or more cores (the recipe's ``cpus_per_task``), whatever
the suite's own setting (tests/conftest.py): torch's reductions round by thread count, so the stored rewards hold
for this count only."""


def run_demo(run: Path, *sets: str) -> tuple[list[float], list[float]]:
    res = subprocess.run([sys.executable, "-m", "relax_hpc", "submit", str(ROOT / "recipes" / "demo.yaml"),
                          "--executor", "local", "--run-dir", str(run), *sets], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **DEMO_THREADS}, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    loss: list[float] = []
    for line in (run / "logs" / "events" / "colocate-0.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "metrics" and "train/loss" in rec.get("metrics", {}):
            loss.append(rec["metrics"]["train/loss"])
    rewards = demo_figures.rewards(run)
    return [rewards[s] for s in sorted(rewards)], loss


@pytest.mark.integration
def test_demo_is_deterministic_and_still_gives_the_stored_rewards(tmp_path: Path) -> None:
    fig = json.loads(GOLDEN.read_text())
    n = len(fig["colocate"]["first_rewards"])
    a = run_demo(tmp_path / "a", "--set", f"num_steps={n}")
    b = run_demo(tmp_path / "b", "--set", f"num_steps={n}")
    assert a == b, "two colocate runs with the same seed differ"
    assert len(a[0]) == n and len(a[1]) == n
    assert a[0] == fig["colocate"]["first_rewards"], (
        "the demo's rewards moved: measure `bash tools/demo.sh` (both modes) again and run "
        "`python tools/demo_figures.py --write ...`")
    no_warmup, _ = run_demo(tmp_path / "c", "--set", f"num_steps={n}", "--set", "warmup.steps=0")
    assert no_warmup == fig["no_warmup"]["first_rewards"]


# ------------------------------------------------------------------------------------------------ recipes
def test_readme_lists_every_shipped_recipe() -> None:
    text = README.read_text()
    missing = [p.name for p in sorted((ROOT / "recipes").glob("*.yaml")) if f"`recipes/{p.name}`" not in text]
    assert not missing, f"README's recipe table lacks {missing}"


def test_every_recipe_validates_for_slurm_or_names_what_is_missing() -> None:
    from tests.helpers.badinput import run_cli

    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        res = run_cli("validate", str(recipe), "--executor", "slurm")
        assert res.rc == 0 and "ok:" in res.out, f"{recipe.name}: {res.err[-1500:]}"
        local = run_cli("validate", str(recipe), "--executor", "local")
        if local.rc != 0:  # one line: no GPU here, or the data with the command that makes it
            errors = [x for x in local.err.splitlines() if x.startswith("error:")]
            assert local.rc == 2 and len(errors) == 1, f"{recipe.name}: {local.err[-1500:]}"
            assert ("no CUDA device" in errors[0] or "relax-hpc data make" in errors[0]
                    or "you supply it" in errors[0]), errors[0]


# ------------------------------------------------------------------------------------------------ commands
def test_every_command_of_the_docs_is_run_or_excused() -> None:
    cluster_pip = 'pip install -e ".[train,monitor]"'
    known = set(NOT_RUN) | set(RUN_README) | set(RUN_CLUSTER)
    for path in (README, CLUSTER):
        for cmd in bash_commands(path):
            key = f"{cmd} (cluster)" if path == CLUSTER and cmd.startswith(cluster_pip) else cmd
            assert key in known, f"{path.name}: `{cmd}` is neither run by a test nor excused in NOT_RUN"


RUN_README = [
    "relax-hpc validate recipes/demo.yaml --set algorithm.clip_high=0.28",
    "relax-hpc submit recipes/demo.yaml --run-dir runs/exp1",
    "relax-hpc submit recipes/demo.yaml --set mode=fully_async --run-dir runs/exp2",
    "relax-hpc monitor runs/exp1 --once",
    "relax-hpc plot runs/exp1 -o curves.png",
    "relax-hpc status runs/exp1",
    "relax-hpc cancel runs/exp2",
    "relax-hpc resume runs/exp2",
    "relax-hpc sweep recipes/demo.yaml --grid trainer.lr=1e-3,2e-3 --grid rollout.n_samples=4,8 --parallel 2",
    "relax-hpc render recipes/qwen3-4b-math-fully-async-vllm.yaml",
    "relax-hpc submit recipes/qwen3-4b-math-fully-async-vllm.yaml --executor slurm --dry-run --run-dir runs/try",
    "relax-hpc data list",
    "relax-hpc export runs/exp1",
]
"""The README's commands, run by :func:`test_readme_commands_run` and the sweep test, in this order."""
RUN_CLUSTER = [
    "relax-hpc validate recipes/qwen3-4b-math-fully-async-vllm.yaml --executor slurm",
    "relax-hpc render recipes/qwen3-4b-math-fully-async-vllm.yaml --set launch.partition=gpu",
    "relax-hpc submit recipes/qwen3-4b-math-fully-async-vllm.yaml --executor slurm --dry-run --run-dir "
    "runs/qwen3-4b-try",
    "relax-hpc data list",
]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A folder where the docs' relative paths work (recipes/ of this checkout) and runs/ is fresh; a PATH
    without sbatch, so `submit` runs locally as on a machine without Slurm."""
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    (tmp_path / "bin").mkdir()
    return tmp_path


def sh(cmd: str, cwd: Path, *more: str, timeout: float = 600, ok: bool = True) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(cmd)
    assert argv[0] == "relax-hpc"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": str(cwd / "bin")}
    res = subprocess.run([sys.executable, "-m", "relax_hpc", *argv[1:], *more], capture_output=True, text=True,
                         cwd=cwd, env=env, timeout=timeout)
    if ok:
        assert res.returncode == 0, f"`{cmd}`: {res.stderr[-3000:]}"
    return res


def test_cluster_first_run_checks(workdir: Path) -> None:
    for cmd in RUN_CLUSTER:
        res = sh(cmd, workdir)
        if " render " in f" {cmd} ":
            assert "#SBATCH --partition=gpu" in res.stdout
    assert (workdir / "runs" / "qwen3-4b-try" / "slurm" / "hetjob.sbatch").is_file()
    res = sh("relax-hpc data make math --out data/math", workdir, ok=False, timeout=120)  # no hub here
    errors = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and "math" in errors[0], res.stderr[-2000:]


@pytest.mark.integration
def test_readme_commands_run(workdir: Path) -> None:
    cmd = dict(enumerate(RUN_README))
    sh(cmd[0], workdir)
    sh(cmd[1], workdir, *SHORT)
    out = sh(cmd[3], workdir).stdout
    assert "exp1" in out or "demo" in out
    sh(cmd[4], workdir)
    assert (workdir / "curves.png").stat().st_size > 10_000
    assert "state: completed" in sh(cmd[5], workdir).stdout
    sh(cmd[12], workdir)
    assert list((workdir / "runs" / "exp1" / "exports").glob("v*/config.json"))
    # exp2: long enough to cancel it once it checkpointed, then resume it to the end
    sh(cmd[2], workdir, *SHORT, "--set", "num_steps=60", "--set", "trainer.checkpoint_every=1",
       "--set", "trainer.async_checkpoint=false", "--detach")
    deadline = time.monotonic() + 300
    while not any((workdir / "runs" / "exp2" / "checkpoints").glob("step_*")):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert "sent SIGTERM" in sh(cmd[6], workdir).stdout
    assert "state: interrupted" in sh(cmd[5].replace("exp1", "exp2"), workdir).stdout
    res = sh(cmd[7], workdir)
    assert "resuming from step" in res.stdout and "run completed" in res.stdout
    for i in (9, 10, 11):
        sh(cmd[i], workdir)
    assert (workdir / "runs" / "try" / "config.json").is_file()


@pytest.mark.integration
def test_readme_sweep_changes_the_result_in_colocate(workdir: Path) -> None:
    # the recipe's warm-up kept (from random weights every reward of a group is often equal: nothing to learn)
    res = sh(RUN_README[8], workdir, "--set", "num_steps=3", "--set", "rollout.prompts_per_step=4",
             "--set", "rollout.batch_prompts=4", "--sweep-dir", "sweeps/readme")
    runs = sorted((workdir / "sweeps" / "readme" / "runs").iterdir())
    assert len(runs) == 4, res.stdout
    series = [tuple(demo_figures.rewards(r).values()) for r in runs]
    assert len(set(series)) == 4, f"two combinations of the README's grid learn the same: {series}"


@pytest.mark.proof
@pytest.mark.integration
def test_fully_async_demo_ends_where_the_readme_says(tmp_path: Path) -> None:
    """fully_async is not deterministic (timing decides which weights generate each batch); the README says its
    demo runs end above 0.8 (mean of the last 50 of 800 steps). The whole demo, in that mode."""
    run = tmp_path / "fa"
    res = subprocess.run([sys.executable, "-m", "relax_hpc", "submit", str(ROOT / "recipes" / "demo.yaml"),
                          "--executor", "local", "--run-dir", str(run), "--set", "mode=fully_async"],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         timeout=1800)
    assert res.returncode == 0, res.stderr[-3000:]
    fig = demo_figures.figures(run)
    assert fig["steps"] == 800 and fig["last_50"] >= 0.8, fig
