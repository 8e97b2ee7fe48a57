"""The ``sglang`` engine against a stand-in server: SGLang cannot run on these machines (no CPU kernels for this
processor; its GPU wheels pin torch 2.9.1), so ``tests/helpers/sglang_standin.py`` stands in for it -- a real HTTP
server
process with a HF model behind SGLang 0.5.10's endpoints that rejects unknown or missing fields, so that drift
between the engine and that API fails loudly. The fast path is a real gloo broadcast from this process (rank 0, the
trainer's role) to the stand-in (rank 1)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from relax_hpc.rollout.engine import GenerateRequest, SamplingParams, SnapshotFolder
from relax_hpc.rundir import RunDir
from tests.helpers.server_util import LoopThread, hf_greedy, hf_model, recipe, recompute_logprobs

pytestmark = [pytest.mark.integration]

STANDIN = Path(__file__).parents[1] / "helpers" / "sglang_standin.py"
PROMPT = [1, 5, 6, 7, 17]


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, loop):
    from relax_hpc.events import EventLog
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.rollout.server import make_server_engine

    rd = RunDir.create(tmp_path_factory.mktemp("sglang") / "run")
    cfg = recipe("sglang", rd.root, command=f"{sys.executable} {STANDIN}", weight_sync="distributed",
                 sync_timeout_s=20, restart_backoff_s=0.2, env={"PYTHONPATH": os.getcwd()})
    tok = build_digits_tokenizer()
    events = EventLog(rd, "rollout", 0)
    engine = make_server_engine(cfg, run_dir=rd, proc="rollout-0", device="cpu", seed=0, tokenizer=tok,
                                events=events)
    loop.run(engine.ensure_started(), timeout=120)
    yield engine, rd, cfg, tok
    loop.run(engine.close(), timeout=60)
    events.close()


def _gen(loop, engine, prompt=PROMPT, *, rid="r", timeout=120, **sp):
    req = GenerateRequest(request_id=rid, prompt_ids=prompt, sampling=SamplingParams(**sp))
    return loop.run(engine.generate(req), timeout=timeout)


def _events(rd: RunDir) -> list[dict]:
    return [json.loads(x) for x in rd.event_log("rollout-0").read_text().splitlines()]


def test_standin_rejects_schema_drift(served):
    engine, _, _, _ = served
    with httpx.Client(trust_env=False) as c:
        r = c.post(engine.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {}, "return_logprobs": 1})
        assert r.status_code == 400 and "unknown field 'return_logprobs'" in r.text
        r = c.post(engine.url + "/update_weights_from_disk", json={"weight_version": "3"})
        assert r.status_code == 400 and "missing field 'model_path'" in r.text
        r = c.post(engine.url + "/generate", json={"input_ids": [1], "sampling_params": {"max_tokens": 3}})
        assert r.status_code == 400 and "max_tokens" in r.text


def test_logprobs_and_versions_from_meta_info(served, loop):
    engine, _, _, tok = served
    res = _gen(loop, engine, rid="lp", n=2, temperature=0.7, max_new_tokens=16, seed=3)
    model = hf_model(folder=engine.setup.model_dir)
    for s in res.samples:
        assert len(s.token_ids) == len(s.logprobs) > 0 and (s.versions == 0).all()
        ref = recompute_logprobs(model, PROMPT, s.token_ids.tolist(), 0.7)
        np.testing.assert_allclose(s.logprobs, ref, atol=1e-5)
    g = _gen(loop, engine, rid="g", temperature=0.0, max_new_tokens=20).samples[0]
    assert g.token_ids.tolist() == hf_greedy(model, PROMPT, 20, tok.eos_token_id)


def _publish(rd: RunDir, engine, version: int, seed: int):
    import torch

    from relax_hpc.weights.publisher import SnapshotPublisher

    model = hf_model(folder=engine.setup.model_dir)
    gen = torch.Generator().manual_seed(seed)
    state = {k: (v + 0.05 * torch.randn(v.shape, generator=gen)).contiguous() for k, v in model.state_dict().items()}
    conf = json.loads((engine.setup.model_dir / "config.json").read_text())
    return SnapshotPublisher(rd, keep_last=10).publish(state, version, version, model_config=conf), state


def test_update_from_disk_sets_weight_version(served, loop):
    engine, rd, _, tok = served
    folder, state = _publish(rd, engine, 1, seed=1)
    loop.run(engine.pause(abort=True))
    loop.run(engine.receive(1, SnapshotFolder(folder)))
    loop.run(engine.resume())
    got = _gen(loop, engine, rid="d", temperature=0.0, max_new_tokens=20).samples[0]
    assert got.token_ids.tolist() == hf_greedy(hf_model(state, folder=engine.setup.model_dir), PROMPT, 20,
                                               tok.eos_token_id)
    assert (got.versions == 1).all()  # from meta_info.weight_version
    with httpx.Client(trust_env=False) as c:
        assert c.get(engine.url + "/model_info").json()["weight_version"] == "1"


def _broadcast(port: int, state: dict, done: list) -> None:
    """Trainer rank 0's side (relax_hpc.weights.server_links.init_group: the group SGLang builds)."""
    import torch.distributed as dist

    from relax_hpc.weights.server_links import destroy_group, init_group

    pg = init_group("gloo", "127.0.0.1", port, rank=0, world_size=2, group_name="relax_weights", timeout_s=60)
    for v in state.values():
        dist.broadcast(v.contiguous(), src=0, group=pg)
    destroy_group(pg)
    done.append(True)


def test_fast_path_gloo_broadcast(served, loop):
    """Trainer rank 0 (a thread of this process) broadcasts two buckets to the server (rank 1) over a group of its
    own; greedy output equals HF with those weights, and the version comes with the tokens."""
    from relax_hpc.rollout.server.base import DistributedSource, GroupInfo
    from relax_hpc.rollout.server.process import free_port

    engine, rd, _, tok = served
    _, state = _publish(rd, engine, 2, seed=2)
    names = list(state)
    metas = [[(k, "float32", list(state[k].shape)) for k in names[:10]],
             [(k, "float32", list(state[k].shape)) for k in names[10:]]]
    port = free_port()
    done: list = []
    th = threading.Thread(target=_broadcast, args=(port, state, done), daemon=True)
    th.start()
    src = DistributedSource(GroupInfo("127.0.0.1", port, world_size=2, backend="gloo"), metas)
    before = engine.stats.fallbacks
    loop.run(engine.pause(abort=True))
    loop.run(engine.receive(2, src), timeout=60)
    loop.run(engine.resume())
    th.join(30)
    assert done and engine.stats.fallbacks == before and engine.version == 2
    got = _gen(loop, engine, rid="fp", temperature=0.0, max_new_tokens=20).samples[0]
    assert got.token_ids.tolist() == hf_greedy(hf_model(state, folder=engine.setup.model_dir), PROMPT, 20,
                                               tok.eos_token_id)
    assert (got.versions == 2).all()


def test_fast_path_failure_falls_back_to_files(served, loop):
    """Nobody broadcasts (a trainer that died): the bounded wait runs out, the engine loads the snapshot of the
    same version from the files and logs it."""
    from relax_hpc.rollout.server.base import DistributedSource, GroupInfo
    from relax_hpc.rollout.server.process import free_port

    engine, rd, _, tok = served
    _, state = _publish(rd, engine, 3, seed=3)
    metas = [[(k, "float32", list(v.shape)) for k, v in state.items()]]
    engine.cfg.sync_timeout_s = 4.0
    src = DistributedSource(GroupInfo("127.0.0.1", free_port(), world_size=2, backend="gloo"), metas)
    loop.run(engine.pause(abort=True))
    loop.run(engine.receive(3, src), timeout=120)
    loop.run(engine.resume())
    assert engine.version == 3 and engine.stats.fallbacks >= 1
    fb = [e for e in _events(rd) if e.get("event") == "weight_sync_fallback"]
    assert fb and "version 3" in fb[-1]["message"] and "v3" in fb[-1]["message"]
    got = _gen(loop, engine, rid="fb", temperature=0.0, max_new_tokens=20, timeout=200).samples[0]
    assert got.token_ids.tolist() == hf_greedy(hf_model(state, folder=engine.setup.model_dir), PROMPT, 20,
                                               tok.eos_token_id)


def test_abort_resubmit_versions(served, loop):
    from relax_hpc.rollout.server.partial import generate_resumable, update_weights

    engine, rd, cfg, _ = served
    # The update must land while samples are generating; how long 240 tokens take depends on the machine, so the
    # delay before the update shrinks until an attempt cuts some samples (as the vLLM suite's test does).
    for attempt, delay in enumerate((0.3, 0.1, 0.03, 0.01, 0.0)):
        old = engine.version
        folder, _ = _publish(rd, engine, old + 1, seed=5 + attempt)
        reqs = [GenerateRequest(request_id=f"p{attempt}.{i}", prompt_ids=[1, 5 + i, 6, 17],
                                sampling=SamplingParams(temperature=0.0, max_new_tokens=240)) for i in range(4)]
        futs = [loop.submit(generate_resumable(engine, r, max_resubmits=cfg.rollout.server.max_resubmits))
                for r in reqs]
        time.sleep(delay)
        loop.run(update_weights(engine, old + 1, SnapshotFolder(folder), partial_rollout=True))
        results = [f.result(200) for f in futs]
        cut = [res.samples[0] for res, n in results if n > 0]
        if cut:
            break
    assert cut, "no request was in flight when the update landed, at any delay"
    for s in cut:
        k = int((s.versions == old).sum())
        assert k < len(s.versions) and (s.versions[:k] == old).all() and (s.versions[k:] == old + 1).all()
        assert s.finish_reason in ("stop", "length") and len(s.token_ids) <= 240


def test_sigkill_restart(served, loop):
    engine, rd, _, _ = served
    v = engine.version
    pid = engine.server.proc.pid
    os.killpg(pid, signal.SIGKILL)
    engine.server.proc.wait(10)
    res = _gen(loop, engine, rid="k", temperature=0.0, max_new_tokens=10, n=2, timeout=200)
    assert engine.server.proc.pid != pid and engine.version == v
    assert all((s.versions == v).all() and len(s.token_ids) > 0 for s in res.samples)
    assert any(e.get("event") == "server_died" and e.get("kind") == "alert" for e in _events(rd))


def test_server_killed_before_a_weight_update_and_a_pause(served, loop):
    """The server dies between generations (a SIGKILL while the worker updates weights, seen in a vLLM run): the weight
    load and the pause restart it (backoff, alert) and are made again; the update lands, generation goes on."""
    engine, rd, _, tok = served
    restarts = engine.stats.server_restarts
    folder, state = _publish(rd, engine, engine.version + 1, seed=11)
    pid = engine.server.proc.pid
    os.killpg(pid, signal.SIGKILL)
    loop.run(engine.receive(engine.version + 1, SnapshotFolder(folder)), timeout=200)
    assert engine.server.proc.pid != pid and engine.stats.server_restarts == restarts + 1
    got = _gen(loop, engine, rid="kw", temperature=0.0, max_new_tokens=20, timeout=200).samples[0]
    assert got.token_ids.tolist() == hf_greedy(hf_model(state, folder=engine.setup.model_dir), PROMPT, 20,
                                               tok.eos_token_id)
    pid = engine.server.proc.pid
    os.killpg(pid, signal.SIGKILL)
    loop.run(engine.pause(abort=True), timeout=200)
    loop.run(engine.resume(), timeout=60)
    assert engine.server.proc.pid != pid and engine.stats.server_restarts == restarts + 2
    assert len(_gen(loop, engine, rid="kp", temperature=0.0, max_new_tokens=5, timeout=200).samples[0].token_ids) > 0


def test_unknown_server_flag_fails_at_start(tmp_path, loop):
    """A flag the server does not know (CLI drift): the start fails with one error naming the log."""
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.rollout.server import make_server_engine
    from relax_hpc.rollout.server.process import ServerStartError

    rd = RunDir.create(tmp_path / "run")
    cfg = recipe("sglang", rd.root, command=f"{sys.executable} {STANDIN}", extra_args=["--no-such-flag"],
                 env={"PYTHONPATH": os.getcwd()})
    engine = make_server_engine(cfg, run_dir=rd, proc="rollout-0", device="cpu", seed=0,
                                tokenizer=build_digits_tokenizer())
    with pytest.raises(ServerStartError) as err:
        loop.run(engine.ensure_started(), timeout=120)
    first = str(err.value).splitlines()[0]
    assert "exited at start (exit code 2)" in first and str(rd.server_log("rollout-0-0")) in first
    assert "--no-such-flag" in str(err.value)
    loop.run(engine.close())


def test_make_engine_dispatch(tmp_path):
    from relax_hpc.errors import UserError
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.rollout.factory import make_engine
    from relax_hpc.rollout.server.sglang import SGLangEngine
    from relax_hpc.rollout.server.vllm import VLLMEngine
    from relax_hpc.trainer.checks import check_backends

    rd = RunDir.create(tmp_path / "run")
    tok = build_digits_tokenizer()
    for kind, cls in (("sglang", SGLangEngine), ("vllm", VLLMEngine)):
        cfg = recipe(kind, rd.root)
        check_backends(cfg)  # shipped: allowed
        engine = make_engine(cfg, tokenizer=tok, device="cpu", run_dir=rd, proc="rollout-3")
        assert isinstance(engine, cls) and engine.server is None  # starts at first use
        assert engine.setup.record == rd.server_record("rollout-3-0")
        with pytest.raises(UserError, match="cannot share the trainer's module"):
            make_engine(cfg, tokenizer=tok, device="cpu", run_dir=rd, model=object())
        with pytest.raises(ValueError, match="needs the run dir"):
            make_engine(cfg, tokenizer=tok, device="cpu")
