"""GenRM: a judge model scores responses through the in-process hf engine (a real tiny model), batched and async,
with the prompt template and score parser from the recipe; latency, unreadable verdicts and failed calls counted."""

from __future__ import annotations

import threading
import time

import pytest

from relax_hpc.config.schema import RewardConfig
from relax_hpc.models.multimodal import build_tiny_bpe_tokenizer
from relax_hpc.rewards.genrm import GenRM, hf_judge, parse_score
from relax_hpc.rewards.runner import RewardRunner

pytest.importorskip("torch")


def test_parse_score():
    assert parse_score("blah SCORE: 1", r"SCORE:\s*([01](?:\.\d+)?)") == 1.0
    assert parse_score("SCORE: 0 ... SCORE: 0.75", r"SCORE:\s*([01](?:\.\d+)?)") == 0.75  # the last verdict
    assert parse_score("rating 7/10", r"rating (\d+)/10") == 1.0  # clipped to [0, 1]
    assert parse_score("no verdict", r"SCORE:\s*(\d)") is None


def test_a_tiny_hf_judge_runs_batched_and_counts_what_it_cannot_read():
    generate, tok = hf_judge("tiny", max_new_tokens=6)
    rm = GenRM(generate, tok, batch_size=4, pattern=r"SCORE:\s*([01])", on_unparsed=0.0)
    texts = generate([rm.prompt_ids("42", "42", {"question": "6 x 7?"})])
    assert len(texts) == 1 and isinstance(texts[0], str)
    import asyncio

    scores = asyncio.run(rm.score([f"answer {i}" for i in range(6)], ["3"] * 6, [{"question": "q"}] * 6))
    assert len(scores) == 6 and rm.stats.calls == 2 and rm.stats.samples == 6 and len(rm.stats.latency_s) == 2
    # a random-weight judge does not write "SCORE: x": its verdicts are counted as failures and score on_unparsed
    assert rm.stats.failures == sum(1 for s in scores if s == 0.0) and rm.stats.errors == 0
    assert rm.stats.metrics()["genrm/latency_max_s"] > 0


def test_batches_run_concurrently_and_a_slow_call_times_out():
    """The judge interface is a plain ``generate(ids) -> texts``; here one that grades by looking for the reference in
    the response, to check parsing, concurrency and timeouts without a model's randomness."""
    tok = build_tiny_bpe_tokenizer()
    active, peaks = [], []
    lock = threading.Lock()

    def generate(prompts):
        with lock:
            active.append(1)
            peak = len(active)
        time.sleep(0.3 if len(prompts) > 1 else 2.0)  # the last, single-prompt batch is too slow
        with lock:
            active.pop()
        out = []
        for p in prompts:
            text = tok.decode(p)
            resp = text.split("Response: ")[1].split("\n")[0]
            ref = text.split("Reference answer: ")[1].split("\n")[0]
            out.append(f"SCORE: {int(resp.strip() == ref.strip())}")
        peaks.append(peak)
        return out

    import asyncio

    rm = GenRM(generate, tok, batch_size=2, max_concurrency=2, timeout_s=1.0, on_unparsed=-1.0, chat_template=False)
    t0 = time.perf_counter()
    scores = asyncio.run(rm.score(["12", "13", "7", "8", "9"], ["12", "12", "7", "7", "9"]))
    assert scores == [1.0, 0.0, 1.0, 0.0, -1.0]  # the timed-out batch scores on_unparsed
    assert rm.stats.errors == 1 and rm.stats.failures == 0 and rm.stats.calls == 3
    assert time.perf_counter() - t0 < 1.9  # the answer came before the slow call (2 s) ended: it was cut at 1 s
    assert max(peaks) == 2  # two judge calls ran at once (max_concurrency)


def test_genrm_from_a_recipe_through_the_reward_runner():
    cfg = RewardConfig(name="relax_hpc.rewards.genrm:judge",
                       kwargs={"model": "tiny", "batch_size": 3, "max_new_tokens": 4,
                               "template": "Q: {question} A: {response} Ref: {answer} SCORE:"})
    res = RewardRunner(cfg).score(["1", "2", "3", "4"], ["1"] * 4, [{"question": "?"}] * 4)
    assert len(res.rewards) == 4 and "genrm_failures" in res.extras and "genrm_latency_mean_s" in res.extras
    assert 0 <= float(res.extras["genrm_failures"][-1]) <= 4 and res.num_errors == 0
    with pytest.raises(ValueError, match="template must contain"):
        GenRM(lambda p: [], build_tiny_bpe_tokenizer(), template="no placeholder")
