"""GenRM on the rollout's own engine (``reward.kwargs.model: rollout``): the judge is the policy model on the tiny
``hf`` engine the rollout generates with (threaded, as in a fully_async worker, and unthreaded, as in colocate, where
batches run on the caller's thread), reached through the reward's ``context``; its requests go through the engine
after the rollout's, on the driver's loop; a paused engine times the judge out (counted), never hangs it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from relax_hpc.config.schema import RewardConfig
from relax_hpc.data.dataset import Prompt

pytest.importorskip("torch")

TEMPLATE = "Q: {question} A: {response} Ref: {answer} SCORE:"


def _engine(threaded: bool) -> Any:
    import torch

    from relax_hpc.config.schema import ModelConfig, SamplingConfig
    from relax_hpc.models.load import load_model, load_tokenizer
    from relax_hpc.rollout.hf_engine import HFEngine

    mcfg = ModelConfig(path="tiny", tokenizer="builtin:bpe")
    tok = load_tokenizer(mcfg)
    model = load_model(mcfg, tok, device="cpu", dtype=torch.float32, seed=0).eval()
    return HFEngine(model, tok, SamplingConfig(temperature=1.0, max_new_tokens=6), batch_prompts=16, seed=0,
                    decoder="generate", shared=not threaded, threaded=threaded), tok


def _runner(engine: Any, tok: Any, **kwargs: Any) -> Any:
    from relax_hpc.rewards.api import RewardContext
    from relax_hpc.rewards.runner import RewardRunner

    cfg = RewardConfig(name="relax_hpc.rewards.genrm:judge",
                       kwargs={"model": "rollout", "batch_size": 3, "max_new_tokens": 4, "template": TEMPLATE,
                               **kwargs})
    return RewardRunner(cfg, RewardContext(engine=engine, tokenizer=tok, name="w0"))


def _judge(runner: Any) -> Any:
    (rm,) = runner.context.state.values()
    return rm


@pytest.mark.parametrize("threaded", [True, False], ids=["threaded", "colocate-unthreaded"])
def test_the_rollout_engine_judges_the_batch_it_generated(threaded):
    from relax_hpc.rollout.driver import RolloutDriver
    from relax_hpc.rollout.engine import SamplingParams

    engine, tok = _engine(threaded)
    runner = _runner(engine, tok)
    assert runner.on_loop
    driver = RolloutDriver(engine, tok, runner, sampling=SamplingParams(n=2, temperature=1.0, max_new_tokens=6),
                           writer_id="w0")
    try:
        prompts = [Prompt(tok(f"what is {i}+1?")["input_ids"], str(i + 1), {"question": f"{i}+1"})
                   for i in range(4)]
        res = driver.run_batch(prompts)
        assert res.samples == 8 and res.reward_errors == 0 and len(res.groups) == 4
        rm = _judge(runner)
        assert rm.stats.calls == 3 and rm.stats.samples == 8 and rm.stats.errors == 0  # batches of 3, 3, 2
        assert rm.generate.requests == 8 and rm.generate.prefix.startswith("w0/genrm-")
        assert len(rm.stats.latency_s) == 3 and min(rm.stats.latency_s) > 0
        sample = res.groups[0].samples[0]
        assert sample.rewards["genrm_calls"] == 3 and sample.rewards["genrm_version"] == engine.version == 0
        assert res.counts["genrm/calls"] == 3 and res.counts["genrm/samples"] == 8  # logged with the batch
        # a random-weight judge rarely writes "SCORE: x": unread verdicts are failures and score on_unparsed (0)
        assert rm.stats.failures == sum(s.reward == 0.0 for g in res.groups for s in g.samples)
        # the next batch, after new weights (the colocate hand-over of the shared module / a threaded load)
        if not threaded:
            from relax_hpc.rollout.engine import SharedModule

            driver.call(engine.receive(1, SharedModule()))
        else:
            engine.version = 1  # the version a weight load sets; the weights themselves do not matter here
        res2 = driver.run_batch(prompts[:2])
        assert rm.stats.calls == 5 and res2.groups[0].samples[0].rewards["genrm_version"] == 1
        assert res2.counts["genrm/calls"] == 5 and res2.counts["genrm/version"] == 1
    finally:
        driver.close()


def test_a_paused_engine_times_the_judge_out_and_it_goes_on_after_resume():
    engine, tok = _engine(threaded=True)
    runner = _runner(engine, tok, timeout_s=1.0, on_unparsed=-1.0)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.pause(abort=False))
        t0 = time.perf_counter()
        res = loop.run_until_complete(runner.score_async(["1", "2", "3", "4"], ["1"] * 4, [{"question": "?"}] * 4))
        assert time.perf_counter() - t0 < 10  # bounded by timeout_s, not by the pause
        rm = _judge(runner)
        assert rm.stats.errors == 4 and rm.stats.calls == 2 and list(res.rewards) == [-1.0] * 4
        assert res.num_errors == 0  # the judge's errors are its own counts; the reward itself did not fail
        loop.run_until_complete(asyncio.sleep(0.2))  # the background aborts of the timed-out requests
        assert not engine._jobs  # the engine dropped them
        loop.run_until_complete(engine.resume())
        res = loop.run_until_complete(runner.score_async(["1", "2"], ["1"] * 2, [{"question": "?"}] * 2))
        assert rm.stats.errors == 4 and rm.stats.calls == 3 and len(rm.stats.latency_s) == 1
    finally:
        engine.shutdown()
        loop.close()


def test_without_a_rollout_engine_the_judge_fails_with_one_clear_line():
    from relax_hpc.rewards.runner import RewardRunner

    cfg = RewardConfig(name="relax_hpc.rewards.genrm:judge", kwargs={"model": "rollout", "template": TEMPLATE})
    res = RewardRunner(cfg).score(["1", "2"], ["1", "1"])
    assert res.num_errors == 2 and "needs the rollout's engine" in str(res.reasons[0])
    res = RewardRunner(RewardConfig(name="relax_hpc.rewards.genrm:judge",
                                    kwargs={"model": "rollout", "engine": "vllm"})).score(["1"], ["1"])
    assert res.num_errors == 1 and "leave out engine" in str(res.reasons[0])


def test_a_verdict_cut_by_a_pause_for_weights_is_asked_again_whole():
    """The judge's requests wait in a paused engine; the pause turns into one that aborts (new weights come): they
    end aborted, and the judge asks them again; after the resume the new requests give the verdicts."""
    engine, tok = _engine(threaded=True)
    runner = _runner(engine, tok, timeout_s=60.0)

    async def scenario() -> Any:
        await engine.pause(abort=False)
        task = asyncio.ensure_future(runner.score_async(["1", "2", "3"], ["1"] * 3, [{"question": "?"}] * 3))
        for _ in range(500):
            if len(engine._jobs) == 3:
                break
            await asyncio.sleep(0.01)
        first = sorted(engine._jobs)
        assert len(first) == 3 and all(rid.startswith("w0/genrm-") for rid in first)
        await engine.pause(abort=True)  # the queued judge requests end aborted
        for _ in range(500):
            if sorted(engine._jobs) not in ([], first):
                break
            await asyncio.sleep(0.01)
        engine.version = 7  # the weights received during the pause
        await engine.resume()
        return await asyncio.wait_for(task, 60)

    loop = asyncio.new_event_loop()
    try:
        res = loop.run_until_complete(scenario())
    finally:
        engine.shutdown()
        loop.close()
    rm = _judge(runner)
    assert rm.stats.errors == 0 and rm.stats.calls == 1 and res.num_errors == 0
    assert rm.generate.requests == 6  # each verdict asked twice: the aborted request and the new one
    assert rm.generate.version == 7 and float(res.extras["genrm_version"][0]) == 7.0
