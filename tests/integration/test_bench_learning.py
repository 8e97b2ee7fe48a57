"""``relax-hpc bench learning``: real short runs of both modes over two seeds give a complete JSON report whose
per-mode figures are the means of the per-run figures read from the runs' event logs; the comparison arithmetic on
known numbers; bad arguments get one error line."""

from __future__ import annotations

import json
import math

import pytest

from relax_hpc.bench.learning import compare, mean_se
from relax_hpc.rundir import RunDir
from tests.helpers.runutil import cli

SMALL = ["warmup.steps=2", "rollout.prompts_per_step=4", "rollout.batch_prompts=4", "rollout.n_samples=4"]


@pytest.mark.integration
@pytest.mark.slow
def test_bench_learning_json(tmp_path):
    out = tmp_path / "out"
    args = ["bench", "learning", "--json", "--seeds", "0,1", "--steps", "4", "--last", "2", "--mid", "3", "--keep",
            "--out", str(out)]
    for s in SMALL:
        args += ["--set", s]
    r = cli(*args, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["seeds"] == [0, 1] and res["num_steps"] == 4
    for mode in ("colocate", "fully_async"):
        runs = res["runs"][mode]
        assert [x["seed"] for x in runs] == [0, 1]
        for x in runs:
            assert x["steps"] == 4 and x["exit_code"] == 0 and 0.0 <= x["final_reward"] <= 1.0
            # the run's own log says the same: the mean reward of its last 2 steps, with the seed and mode asked
            d = out / f"{mode}-seed{x['seed']}"
            cfg = json.loads((d / "config.json").read_text())
            assert (cfg["mode"], cfg["seed"]) == (mode, x["seed"])
            log = RunDir(d).event_log("colocate-0" if mode == "colocate" else "trainer-0")
            recs = [json.loads(line) for line in log.read_text().splitlines()]
            rewards = {rec["step"]: rec["metrics"]["rollout/reward"] for rec in recs
                       if rec.get("kind") == "metrics" and "rollout/reward" in rec.get("metrics", {})}
            assert x["final_reward"] == pytest.approx((rewards[3] + rewards[4]) / 2)
        assert res[f"final_reward_{mode}"] == pytest.approx(sum(x["final_reward"] for x in runs) / 2)
    assert res["final_reward_difference"] == pytest.approx(res["final_reward_fully_async"]
                                                           - res["final_reward_colocate"])
    assert isinstance(res["same_within_noise"], bool)
    assert json.loads((out / "result.json").read_text())["runs"] == res["runs"]


def test_compare_on_known_numbers():
    assert mean_se([1.0, 3.0]) == (2.0, pytest.approx(1.0))
    m, se = mean_se([0.5])
    assert m == 0.5 and math.isnan(se)

    def runs(*finals: float) -> list[dict]:
        return [{"final_reward": f, "mid_reward": f / 2, "step_s_median": 0.1} for f in finals]
    res = compare({"colocate": runs(0.9, 1.0, 0.8), "fully_async": runs(0.8, 0.9, 0.7)})
    assert res["final_reward_colocate"] == pytest.approx(0.9)
    assert res["final_reward_stderr_colocate"] == pytest.approx(0.1 / math.sqrt(3))
    assert res["final_reward_difference"] == pytest.approx(-0.1)
    assert res["final_reward_difference_stderr"] == pytest.approx(math.sqrt(2) * 0.1 / math.sqrt(3))
    assert res["same_within_noise"] is True  # 0.1 <= 2 x 0.0816
    far = compare({"colocate": runs(0.9, 0.91, 0.9), "fully_async": runs(0.5, 0.51, 0.5)})
    assert far["same_within_noise"] is False
    assert compare({"colocate": runs(0.9), "fully_async": runs(0.5)})["same_within_noise"] is None


def test_bench_learning_rejects_bad_arguments(tmp_path):
    r = cli("bench", "learning", "--seeds", "a,b", timeout=60)
    assert r.returncode == 2 and "--seeds" in r.stderr
    r = cli("bench", "learning", "--recipe", str(tmp_path / "missing.yaml"), timeout=60)
    assert r.returncode == 2 and "not found" in r.stderr
