"""The shipped tiny tool recipe learns through the real pipeline: ``relax-hpc submit
recipes/tiny-digit-lookup-tool.yaml`` (the rollout driver, the episode runner, the hf engine, the torch trainer, the
sample store), in colocate and fully_async.

The answer is a secret only the ``lookup`` tool knows, so guessing succeeds 0.1 of the time. The recipe's supervised
warm-up (``warmup.source: env``: the digit_lookup environment's ``warmup_examples``) teaches reading the tool's
answer after a call and holds the first turn at uniform over the ten digits and the call; whether to call is left to
RL. The episode reward starts near 0.1-0.2 with few calls (about 1 turn in 12 is a call) and ends near 1.0 with a call
in every episode (tool calls per turn 0.5: a call turn and an answer turn). Seeds 0-2 of both modes: docs/benchmarks.md.

A run is not bit-reproducible (tool calls run on threads and episodes finish in timing order, which changes how the
engine batches requests), so a run is a sample of the method: the bounds leave room for that. 150 steps: one CI run
on a loaded machine had reached 0.68 (of the 0.7 asked) at step 100, where runs here reach 0.92-0.94.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.runutil import REPO, cli, metrics

RECIPE = REPO / "recipes" / "tiny-digit-lookup-tool.yaml"
STEPS = 150


def _trajectory(run: Path, proc: str) -> tuple[list[float], list[float]]:
    recs = [r["metrics"] for r in metrics(run, proc) if "agent/episode_reward" in r["metrics"]]
    return [m["agent/episode_reward"] for m in recs], [m["agent/tool_calls_per_turn"] for m in recs]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize(("mode", "proc"), [  # colocate in the proofs (CI time): test_envs_modes runs the env there
    pytest.param("colocate", "colocate-0", marks=pytest.mark.proof), ("fully_async", "trainer-0")])
def test_tiny_tool_recipe_learns_to_call_the_tool(tmp_path: Path, mode: str, proc: str) -> None:
    run = tmp_path / "run"
    out = cli("submit", str(RECIPE), "--executor", "local", "--run-dir", str(run), "--set", f"mode={mode}",
              "--set", f"num_steps={STEPS}", timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert any("warmup/loss" in r["metrics"] for r in metrics(run, proc)), "the recipe's warm-up did not run"
    reward, calls = _trajectory(run, proc)
    assert len(reward) >= STEPS
    r0, r1 = sum(reward[:5]) / 5, sum(reward[-10:]) / 10
    c0, c1 = sum(calls[:5]) / 5, sum(calls[-10:]) / 10
    assert r0 <= 0.4 and c0 <= 0.3, (r0, c0)  # it does not start out calling
    assert r1 >= 0.7 and r1 >= r0 + 0.4, (r0, r1)  # guessing alone gives 0.1
    assert c1 >= 0.4 and c1 >= c0 + 0.2, (c0, c1)  # a call in (nearly) every episode: 0.5 per turn
