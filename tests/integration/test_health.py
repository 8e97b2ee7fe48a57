"""Runs that cannot learn are reported loudly: NaN/inf stops the run (or is skipped and counted), a mostly failing
reward and cut responses alert, hopeless settings warn at start. Unit checks on RunHealth, then real runs."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from relax_hpc.config.load import load_recipe
from relax_hpc.events import EventLog
from relax_hpc.health import NonFiniteError, RunHealth
from relax_hpc.rundir import RunDir
from tests.helpers.badinput import run_cli
from tests.helpers.runutil import DEMO, cli, events, metrics


def _health(tmp_path: Path, *overrides: str) -> tuple[RunHealth, RunDir]:
    rd = RunDir.create(tmp_path / "run")
    cfg = load_recipe(DEMO, list(overrides))
    return RunHealth(cfg, EventLog(rd, "trainer", 0)), rd


def _alerts(rd: RunDir) -> list[dict]:
    return [r for r in events(rd.root, "trainer-0") if r.get("kind") == "alert"]


@pytest.mark.parametrize("key", ["train/loss", "train/grad_norm", "train/pg_loss"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nonfinite_stops_with_an_alert(tmp_path: Path, key: str, value: float) -> None:
    h, rd = _health(tmp_path)
    assert h.check({"train/loss": 0.5, "train/grad_norm": 1.0}, 1) == {}
    with pytest.raises(NonFiniteError, match=key):
        h.check({"train/loss": 0.5, "train/grad_norm": 1.0, key: value}, 2)
    assert [a["event"] for a in _alerts(rd)] == ["nonfinite_loss"]


def test_nonfinite_skip_counts_then_stops(tmp_path: Path) -> None:
    h, rd = _health(tmp_path, "trainer.on_nonfinite=skip", "trainer.max_nonfinite_skips=2")
    assert h.check({"train/loss": math.nan}, 1) == {"train/nonfinite_skipped": 1.0}
    assert h.check({"train/loss": 0.1}, 2) == {"train/nonfinite_skipped": 1.0}  # the streak is broken
    assert h.check({"train/loss": math.nan}, 3) == {"train/nonfinite_skipped": 2.0}
    assert h.check({"train/loss": math.nan}, 4) == {"train/nonfinite_skipped": 3.0}
    with pytest.raises(NonFiniteError, match="3 non-finite steps in a row"):
        h.check({"train/loss": math.nan}, 5)
    assert [a["event"] for a in _alerts(rd)] == ["nonfinite_skipped", "nonfinite_stopped"]


def test_mostly_failing_reward_alerts_once(tmp_path: Path) -> None:
    h, rd = _health(tmp_path)
    h.check({"reward/errors": 1.0, "reward/samples": 32.0}, 1)
    assert not _alerts(rd)
    for step in range(2, 6):
        h.check({"reward/errors": 30.0, "reward/samples": 32.0}, step)
    assert [a["event"] for a in _alerts(rd)] == ["reward_errors"]


def test_truncated_responses_alert(tmp_path: Path) -> None:
    h, rd = _health(tmp_path)
    h.check({"rollout/truncated_fraction": 0.1, "rollout/num_samples": 64.0}, 1)
    assert not _alerts(rd)
    for step in range(2, 7):
        h.check({"rollout/truncated_fraction": 0.95, "rollout/num_samples": 64.0}, step)
    alerts = _alerts(rd)
    assert [a["event"] for a in alerts] == ["responses_truncated"] and "max_new_tokens=8" in alerts[0]["message"]


@pytest.mark.parametrize("overrides,needle", [
    (["rollout.n_samples=1"], "group advantage is 0"),
    (["rollout.sampling.max_new_tokens=62"], "exceed the model's context length"),
    (["algorithm.name=distill", "algorithm.distill.teacher=tiny", "algorithm.distill.coef=0"], "advantage is 0"),
])
def test_start_warnings(overrides: list[str], needle: str) -> None:
    sets = [x for o in overrides for x in ("--set", o)]
    res = run_cli("validate", str(DEMO), "--executor", "local", *sets)
    assert res.rc == 0 and any(needle in line for line in res.err.splitlines() if line.startswith("warning:"))
    assert "warning" not in run_cli("validate", str(DEMO), "--executor", "local").err


NAN_ALGO = '''
from relax_hpc.algorithms.grpo import ALGORITHM as _GRPO


class PoisonedGRPO:
    """GRPO whose loss is NaN: stands for a run that diverged."""

    def __getattr__(self, name):
        return getattr(_GRPO, name)

    def sequence_advantages(self, *args):
        return _GRPO.sequence_advantages(*args)

    def loss(self, x, cfg):
        loss, parts = _GRPO.loss(x, cfg)
        return loss * float("nan"), parts


ALGORITHM = PoisonedGRPO()
'''

RUN = ["--executor", "local", "--set", "num_steps=4", "--set", "warmup.steps=0",
       "--set", "rollout.prompts_per_step=4", "--set", "rollout.n_samples=4",
       "--set", "algorithm.name=nanalgo:ALGORITHM", "--set", "trainer.checkpoint_every=50"]


@pytest.fixture
def nan_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "nanalgo.py").write_text(NAN_ALGO)
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.integration
def test_nan_loss_run_fails_loudly(tmp_path: Path, nan_env: dict[str, str]) -> None:
    rd = tmp_path / "run"
    res = cli("submit", str(DEMO), "--run-dir", str(rd), *RUN, env=nan_env, timeout=300)
    assert res.returncode != 0, res.stdout[-1000:]
    status = json.loads((rd / "STATUS.json").read_text()) if (rd / "STATUS.json").exists() else {}
    assert status.get("state") != "completed"
    alerts = [r for r in events(rd, "colocate-0") if r.get("kind") == "alert"]
    assert alerts and alerts[0]["event"] == "nonfinite_loss" and "stopping the run" in alerts[0]["message"]


@pytest.mark.integration
def test_nan_loss_skipped_and_counted(tmp_path: Path, nan_env: dict[str, str]) -> None:
    rd = tmp_path / "run"
    res = cli("submit", str(DEMO), "--run-dir", str(rd), *RUN, "--set", "trainer.on_nonfinite=skip", env=nan_env,
              timeout=300)
    assert res.returncode == 0, res.stdout[-1000:] + res.stderr[-2000:]
    assert json.loads((rd / "STATUS.json").read_text())["state"] == "completed"
    skipped = [m["metrics"].get("train/nonfinite_skipped") for m in metrics(rd, "colocate-0")
               if "train/loss" in m["metrics"]]
    assert skipped == [1.0, 2.0, 3.0, 4.0]
    assert [r["event"] for r in events(rd, "colocate-0") if r.get("kind") == "alert"] == ["nonfinite_skipped"]
