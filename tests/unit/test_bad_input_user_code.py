"""Bad inputs a new user hits that used to slip through: each gives one ``error:`` line and exit 2.

* a reward function that returns a string (the run went on, every sample scoring 0);
* a reward module that calls ``sys.exit()`` when imported (``validate`` exited 0 with no output);
* ``relax-hpc sweep --sweep-dir`` on a read-only folder (a traceback);
* ``validate`` of what this machine cannot run (no GPU, data not made yet): an error naming the command that makes
  the data for a local run, a warning with ``--executor slurm``; a hub name that cannot be checked offline warns.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from relax_hpc.config.schema import RewardConfig
from relax_hpc.errors import ConfigError
from relax_hpc.rewards.runner import RewardRunner
from tests.helpers.badinput import assert_one_error, run_cli

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "recipes" / "demo.yaml"
SHORT = ["--set", "num_steps=2", "--set", "warmup.steps=0", "--set", "rollout.prompts_per_step=2",
         "--set", "rollout.batch_prompts=2", "--set", "rollout.n_samples=2"]


def cli(*argv: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "relax_hpc", *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def one_error(res: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert res.returncode == 2, f"exit {res.returncode}: {res.stdout[-1000:]} {res.stderr[-2000:]}"
    lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------------------ rewards
def test_reward_returning_a_string_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text("def fn(response, answer):\n    return '1.0'\n")
    runner = RewardRunner(RewardConfig(name=f"{tmp_path}/r.py:fn"))
    with pytest.raises(ConfigError) as info:
        runner.score(["1", "2"], ["1", "2"])
    assert "returned a str ('1.0')" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["None", "[1.0]", "{'reward': 'high'}"])
def test_reward_of_a_type_that_is_never_a_number_is_a_user_error(tmp_path: Path, value: str) -> None:
    (tmp_path / "r.py").write_text(f"def fn(response, answer):\n    return {value}\n")
    with pytest.raises(ConfigError, match=r"not a number|returned"):
        RewardRunner(RewardConfig(name=f"{tmp_path}/r.py:fn")).score(["1"], ["1"])


@pytest.mark.integration
def test_run_with_a_string_reward_stops_with_one_error_line(tmp_path: Path) -> None:
    (tmp_path / "r.py").write_text("def fn(response, answer):\n    return 'yes'\n")
    res = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(tmp_path / "run"), *SHORT,
              "--set", f"reward.name={tmp_path}/r.py:fn")
    one_error(res, "returned a str ('yes')", "reward.name")
    assert "run failed (exit code 2)" in res.stderr
    assert (tmp_path / "run" / "config.json").is_file()  # nothing already written is lost


def test_reward_module_calling_sys_exit_at_import(tmp_path: Path) -> None:
    for code in ("sys.exit()", "sys.exit(0)", "sys.exit(3)"):
        (tmp_path / "r.py").write_text(f"import sys\n{code}\ndef fn(response, answer):\n    return 1.0\n")
        res = cli("validate", str(DEMO), "--set", f"reward.name={tmp_path}/r.py:fn")
        one_error(res, "called sys.exit(", "reward")
        assert "ok:" not in res.stdout


def test_environment_module_calling_sys_exit_at_import(tmp_path: Path) -> None:
    from relax_hpc.plugins import load_object

    (tmp_path / "e.py").write_text("raise SystemExit(1)\n")
    with pytest.raises(ValueError, match=r"called sys\.exit"):
        load_object(f"{tmp_path}/e.py:Env", "environment")


# ------------------------------------------------------------------------------------------------ sweep dir
@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "ro"
    mnt.mkdir()
    if os.geteuid() != 0:
        mnt.chmod(0o555)  # file modes stop a normal user
        yield mnt
        mnt.chmod(0o755)
        return
    src = tmp_path / "src"  # root: a read-only bind mount (file modes do not stop root)
    src.mkdir()
    for cmd in (["mount", "--bind", str(src), str(mnt)], ["mount", "-o", "remount,bind,ro", str(mnt)]):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if res.returncode:
            subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)
            pytest.skip(f"cannot make a read-only bind mount here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)


def test_sweep_dir_on_a_read_only_folder(read_only_dir: Path) -> None:
    res = run_cli("sweep", str(DEMO), "--grid", "trainer.lr=1e-3,2e-3", "--executor", "local",
                  "--sweep-dir", str(read_only_dir / "sweep"))
    assert_one_error(res, "--sweep-dir", str(read_only_dir / "sweep"))


# ------------------------------------------------------------------------------------------------ validate
def test_missing_data_names_the_command_that_makes_it(tmp_path: Path) -> None:
    recipe = ROOT / "recipes" / "tiny-vl-red-squares.yaml"
    data = tmp_path / "red_squares" / "red_squares.jsonl"
    res = run_cli("validate", str(recipe), "--executor", "local", "--set", f"data.path={data}")
    line = assert_one_error(res, str(data), "does not exist")
    assert f"relax-hpc data make red_squares --out {data.parent}" in line
    # the command it names makes the data, and the recipe then validates
    made = run_cli("data", "make", "red_squares", "--out", str(data.parent), "--rows", "8")
    assert made.rc == 0 and data.is_file(), made.err
    ok = run_cli("validate", str(recipe), "--executor", "local", "--set", f"data.path={data}")
    assert ok.rc == 0 and "ok:" in ok.out, ok.err


def test_user_supplied_data_says_so(tmp_path: Path) -> None:
    data = tmp_path / "omni_qa" / "train.jsonl"  # the omni recipe's set, which no command makes
    res = run_cli("validate", str(DEMO), "--executor", "local", "--set", "data.task=null", "--set",
                  f"data.path={data}")
    assert_one_error(res, str(data), "no command makes it: you supply it", "omni-modal QA")


def test_relative_data_path_from_set_says_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    res = run_cli("validate", str(DEMO), "--set", "data.path=nope/train.jsonl", "--executor", "local")
    assert_one_error(res, str(tmp_path / "nope" / "train.jsonl"), "current directory", "recipe's folder")


def test_cannot_run_here_is_a_warning_for_slurm(tmp_path: Path) -> None:
    recipe = ROOT / "recipes" / "qwen3-4b-math-fully-async.yaml"
    local = run_cli("validate", str(recipe), "--executor", "local")
    if "no CUDA device" not in local.err:
        pytest.skip("this machine has a GPU")
    assert_one_error(local, "no CUDA device")
    data = tmp_path / "math" / "train.jsonl"
    slurm = run_cli("validate", str(recipe), "--executor", "slurm", "--set", f"data.path={data}")
    assert slurm.rc == 0 and "ok:" in slurm.out, slurm.err
    warnings = [x for x in slurm.err.splitlines() if x.startswith("warning:")]
    assert any("cannot run on this machine" in w and "relax-hpc data make math" in w for w in warnings), slurm.err
    assert any("Qwen/Qwen3-4B" in w and "hub name" in w for w in warnings), slurm.err
    # a schema error stays an error there
    assert_one_error(run_cli("validate", str(recipe), "--executor", "slurm", "--set", "trainer.lr=-1"), "trainer.lr")


def test_misspelt_hub_name_warns() -> None:
    res = run_cli("validate", str(DEMO), "--set", "model.path=Qwen/Qwen3-4BB", "--set", "data.task=null",
                  "--set", f"data.path={ROOT}/recipes/data/arithmetic.jsonl", "--executor", "local")
    warnings = [x for x in res.err.splitlines() if x.startswith("warning:")]
    assert any("'Qwen/Qwen3-4BB' is a hub name" in w and "not checked" in w for w in warnings), res.err
