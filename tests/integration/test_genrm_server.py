"""GenRM on a server engine: the judge runs in a real server process of its own -- the SGLang stand-in
(``tests/helpers/sglang_standin.py``: SGLang cannot run on these machines; a real HTTP server with a HF model behind
SGLang 0.5.10's endpoints) -- with fixed weights, batched (a batch's prompts in flight at once) and async (batches
concurrently); its verdicts are the served model's own greedy continuations, and a failing call is counted."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from relax_hpc.rewards.genrm import GenRM, ServerJudge
from tests.helpers.server_util import hf_greedy, hf_model

pytestmark = [pytest.mark.integration]
STANDIN = Path(__file__).parents[1] / "helpers" / "sglang_standin.py"


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    server = {"command": f"{sys.executable} {STANDIN}", "startup_timeout_s": 300, "stop_grace_s": 5,
              "request_timeout_s": 120, "restart_backoff_s": 0.2, "env": {"PYTHONPATH": os.getcwd()}}
    sj = ServerJudge("tiny", engine="sglang", workdir=tmp_path_factory.mktemp("judge") / "run", server=server,
                     max_new_tokens=8)
    yield sj
    proc = sj.engine.server.proc if sj.engine.server else None
    sj.close()
    assert proc is None or proc.returncode is not None  # the server process is gone


def test_server_judge_scores_batched_async_and_counts_failures(judge):
    model = hf_model(folder=judge.engine.setup.model_dir)
    eos = judge.tokenizer.eos_token_id
    # a pattern the random-weight judge's verdicts sometimes match: some parse, some count as failures
    rm = GenRM(judge.generate, judge.tokenizer, template="Q: {question}\nA: {response}\nRef: {answer}\nScore:",
               pattern=r"([0-9])", batch_size=3, max_concurrency=2, timeout_s=120, on_unparsed=-1.0,
               chat_template=False)
    responses = [f"the answer is {i}" for i in range(7)]
    scores = asyncio.run(rm.score(responses, [str(i) for i in range(7)], [{"question": "2+2"}] * 7))
    # each verdict is the served model's greedy continuation of the judge prompt: parse it the same way here
    want = []
    for r, a in zip(responses, [str(i) for i in range(7)], strict=True):
        ids = rm.prompt_ids(r, a, {"question": "2+2"})
        text = judge.tokenizer.decode(hf_greedy(model, ids, 8, eos), skip_special_tokens=True)
        found = [c for c in text if c.isdigit()]
        want.append(min(1.0, float(found[-1])) if found else -1.0)
    assert scores == want
    m = rm.stats.metrics()
    assert m["genrm/calls"] == 3 and m["genrm/samples"] == 7  # batches of 3, 3 and 1
    assert m["genrm/failures"] == sum(s == -1.0 for s in want) and m["genrm/errors"] == 0
    assert m["genrm/latency_mean_s"] > 0 and m["genrm/latency_max_s"] >= m["genrm/latency_mean_s"]


def test_a_prompt_beyond_the_servers_context_gets_no_verdict_and_the_judge_goes_on(judge):
    """The sglang engine sends no request whose prompt fills the server's context (SGLang would refuse it with HTTP
    400): such samples end at once with no tokens (``length``), so their verdicts are unparsed, not server errors."""
    rm = GenRM(judge.generate, judge.tokenizer, template="{response}", pattern=r"([0-9])", batch_size=2,
               timeout_s=120, on_unparsed=0.25, chat_template=False)
    too_long = "9 " * 2000  # beyond the server's context: no verdict; the other samples are scored
    scores = asyncio.run(rm.score([too_long, "1", "2 3", "4"], ["1"] * 4))
    m = rm.stats.metrics()
    assert m["genrm/errors"] == 0 and m["genrm/calls"] == 2 and scores[0] == 0.25 and m["genrm/failures"] >= 1
    assert len(scores) == 4 and m["genrm/latency_mean_s"] > 0
    assert judge.generate([rm.prompt_ids("5", "1", None)])  # the server still answers
