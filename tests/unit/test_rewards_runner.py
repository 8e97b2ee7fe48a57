"""RewardRunner over every kind of user function, errors and timeouts in both on_error modes, and validation."""

from __future__ import annotations

import asyncio
import math
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.config.load import validate_dict
from relax_hpc.config.schema import RewardConfig
from relax_hpc.errors import ConfigError
from relax_hpc.launch.checks import check_plugins
from relax_hpc.rewards import RewardRunner, batched, check_reward

HERE = sys.modules[__name__].__name__


# ------------------------------------------------------------------------------------------------ user functions
def sync_single(response: str, answer: str, *, bonus: float = 0.0) -> float:
    return float(response == answer) + bonus


async def async_single(response: str, answer: str) -> float:
    await asyncio.sleep(0.05)
    return float(response == answer)


@batched
def sync_batched(responses: list[str], answers: list[str]) -> list[float]:
    return [float(r == a) for r, a in zip(responses, answers, strict=True)]


@batched()
async def async_batched(responses: list[str], answers: list[str]) -> list[float]:
    await asyncio.sleep(0.01)
    return [len(r) / 10 for r in responses]


def dict_valued(response: str, answer: str) -> dict[str, float]:
    return {"reward": float(response == answer), "length": float(len(response)), "correct_format": True}


def flaky(response: str, answer: str) -> float:
    if response == "raise":
        raise RuntimeError("boom")
    if response == "nan":
        return math.nan
    if response == "inf":
        return math.inf
    if response == "str":
        return "1.0"  # type: ignore[return-value]
    return 1.0


async def slow_sometimes(response: str, answer: str) -> float:
    if response == "slow":
        await asyncio.sleep(30)
    return 1.0


@batched
def wrong_length(responses: list[str], answers: list[str]) -> list[float]:
    return [1.0]


def with_meta(response: str, answer: str, meta: dict) -> float:
    return float(meta["weight"])


@batched
def with_metas(responses: list[str], answers: list[str], metas: list[dict]) -> list[float]:
    return [float(m["weight"]) for m in metas]


def returns_coroutine(response: str, answer: str):
    return async_single(response, answer)


NOT_CALLABLE = 3


def runner(name: str, **kw) -> RewardRunner:
    return RewardRunner(RewardConfig(name=f"{HERE}:{name}", **kw))


# ------------------------------------------------------------------------------------------------ kinds
def test_sync_single_with_kwargs():
    res = runner("sync_single", kwargs={"bonus": 0.5}).score(["a", "b"], ["a", "a"])
    assert res.rewards.dtype == np.float32
    np.testing.assert_allclose(res.rewards, [1.5, 0.5])
    assert not res.failed.any() and res.counts == {"reward/samples": 2, "reward/errors": 0, "reward/timeouts": 0}


def test_async_single_runs_concurrently():
    import time

    r = runner("async_single")
    t0 = time.monotonic()
    res = r.score(["x"] * 20, ["x"] * 10 + ["y"] * 10)
    assert time.monotonic() - t0 < 0.8  # 20 x 50 ms sleeps overlap
    np.testing.assert_array_equal(res.rewards, [1.0] * 10 + [0.0] * 10)


def test_async_inside_a_running_event_loop():
    async def main():
        return runner("async_single").score(["x", "y"], ["x", "x"])

    np.testing.assert_array_equal(asyncio.run(main()).rewards, [1.0, 0.0])


def test_empty_batch():
    for name in ("sync_single", "async_single", "async_batched"):
        res = runner(name).score([], [])
        assert res.rewards.shape == (0,) and res.counts["reward/samples"] == 0


def test_batched_sync_and_async():
    np.testing.assert_array_equal(runner("sync_batched").score(["a", "b", "c"], ["a", "x", "c"]).rewards, [1, 0, 1])
    np.testing.assert_allclose(runner("async_batched").score(["ab", "abcd"], [None, None]).rewards, [0.2, 0.4])


def test_dict_valued_rewards_record_extras():
    res = runner("dict_valued").score(["ab", "xyz"], ["ab", "ab"])
    np.testing.assert_array_equal(res.rewards, [1.0, 0.0])
    np.testing.assert_array_equal(res.extras["length"], [2.0, 3.0])
    np.testing.assert_array_equal(res.extras["correct_format"], [1.0, 1.0])
    m = res.metrics()
    assert m["reward/length"] == pytest.approx(2.5) and m["reward/mean"] == pytest.approx(0.5)


def test_meta_is_passed_when_declared():
    metas = [{"weight": 0.25}, {"weight": 0.75}]
    np.testing.assert_allclose(runner("with_meta").score(["a", "b"], [1, 2], metas).rewards, [0.25, 0.75])
    np.testing.assert_allclose(runner("with_metas").score(["a", "b"], [1, 2], metas).rewards, [0.25, 0.75])


def test_builtin_by_name():
    res = RewardRunner(RewardConfig(name="digits_positional")).score(["321", "3"], ["321", "321"])
    np.testing.assert_allclose(res.rewards, [1.0, 1 / 3])
    res = RewardRunner(RewardConfig(name="math")).score([r"\boxed{6}", r"\boxed{5}"], ["6", "6"])
    np.testing.assert_array_equal(res.rewards, [1.0, 0.0])


# ------------------------------------------------------------------------------------------------ failures
@pytest.mark.parametrize("on_error", ["zero", "drop"])
def test_raising_and_nonfinite_rewards_are_counted_not_fatal(on_error):
    responses = ["ok", "raise", "nan", "inf", "ok", "ok", "ok", "ok"]
    res = runner("flaky", on_error=on_error).score(responses, [None] * 8)
    np.testing.assert_array_equal(res.failed, [False, True, True, True, False, False, False, False])
    np.testing.assert_array_equal(res.rewards, [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # always finite
    assert res.counts["reward/errors"] == res.num_errors == 3
    assert "RuntimeError: boom" in res.reasons[1] and "nan" in res.reasons[2] and "inf" in res.reasons[3]
    assert res.reasons[0] is None
    if on_error == "drop":
        np.testing.assert_array_equal(res.dropped, res.failed)
        np.testing.assert_array_equal(res.group_drop_mask(2), [True, True, False, False])
    else:
        assert not res.dropped.any() and not res.group_drop_mask(4).any()


def test_async_timeout_fails_only_the_slow_samples():
    res = runner("slow_sometimes", timeout_s=0.3).score(["fast", "slow", "fast"], [None] * 3)
    np.testing.assert_array_equal(res.failed, [False, True, False])
    np.testing.assert_array_equal(res.rewards, [1.0, 0.0, 1.0])
    assert res.counts["reward/timeouts"] == 1 and res.counts["reward/errors"] == 1
    assert "timed out" in res.reasons[1]


def test_batched_wrong_length_fails_every_sample():
    res = runner("wrong_length", on_error="drop").score(["a", "b"], [1, 2])
    assert res.failed.all() and res.dropped.all() and "1 values for 2" in res.reasons[0]


def test_sync_function_returning_a_coroutine_is_an_error():
    res = runner("returns_coroutine").score(["a"], ["a"])
    assert res.failed.all() and "async def" in res.reasons[0]


# ------------------------------------------------------------------------------------------------ user files
def test_user_function_in_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "x.py").write_text(textwrap.dedent("""
        def fn(response, answer, scale=1.0):
            return scale * (response.strip() == str(answer))
    """))
    monkeypatch.chdir(tmp_path)
    res = RewardRunner(RewardConfig(name="tmp/x.py:fn", kwargs={"scale": 2.0})).score(["5", "6"], [5, 5])
    np.testing.assert_array_equal(res.rewards, [2.0, 0.0])
    absolute = RewardRunner(RewardConfig(name=f"{tmp_path}/tmp/x.py:fn")).score(["5"], [5])
    np.testing.assert_array_equal(absolute.rewards, [1.0])


def _one_line_error(name: str, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        check_plugins(validate_dict({"data": {"task": {}}, "reward": {"name": name, **kw}}))
    assert len(info.value.problems) == 1
    line = info.value.problems[0]
    assert "\n" not in line and line.startswith("reward")
    return line


def test_validation_rejects_bad_rewards_with_one_line(tmp_path: Path):
    assert "has no attribute 'missing'" in _one_line_error(f"{HERE}:missing")
    assert "No module named" in _one_line_error("no_such_module_xyz:fn")
    assert "not callable" in _one_line_error(f"{HERE}:NOT_CALLABLE")
    assert "does not exist" in _one_line_error(f"{tmp_path}/nope.py:fn")
    assert "neither built-in" in _one_line_error("no_such_builtin")
    assert "reward.kwargs" in _one_line_error("exact_match", kwargs={"no_such_option": 1})
    broken = tmp_path / "broken.py"
    broken.write_text("def fn(:\n")
    assert "SyntaxError" in _one_line_error(f"{broken}:fn")


def test_validation_accepts_good_rewards():
    cfg = check_plugins(validate_dict({"data": {"task": {}},
                                       "reward": {"name": "format", "kwargs": {"pattern": "a+"}}}))
    assert cfg.reward.kwargs == {"pattern": "a+"}
    check_reward("math_answer", {"timeout_s": 3})
    check_reward(f"{HERE}:sync_batched", {})
