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
from tests.helpers.server_util import hf_greedy, hf_model, recipe, recompute_logprobs

pytestmark = [pytest.mark.integration]

STANDIN = Path(__file__).parents[1] / "helpers" / "sglang_standin.py"
PROMPT = [1, 5, 6, 7, 17]


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


def test_standin_answers_as_sglang_does(served):
    """The stand-in's own behaviour, as SGLang 0.5.10 has it (tests/helpers/sglang_standin.py names the source of each):
    unknown body fields ignored, an unknown sampling parameter a 500, a missing field a 400, the context check
    ``>=``, weight failures HTTP 400, the version in /server_info."""
    engine, _, _, _ = served
    ctx = engine.context_length
    with httpx.Client(trust_env=False) as c:
        r = c.post(engine.url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2},
                                                   "return_logprobs": 1})
        assert r.status_code == 200 and len(r.json()["output_ids"]) <= 2  # the misspelled field is ignored
        r = c.post(engine.url + "/generate", json={"input_ids": [1], "sampling_params": {"max_tokens": 3}})
        assert r.status_code == 500
        r = c.post(engine.url + "/update_weights_from_disk", json={"weight_version": "3"})
        assert r.status_code == 400 and "missing field 'model_path'" in r.text
        r = c.post(engine.url + "/generate", json={"input_ids": [1] * 4, "sampling_params": {
            "max_new_tokens": ctx - 4, "temperature": 0.0}})
        assert r.status_code == 400 and "exceeds the model's maximum context length" in r.text
        r = c.post(engine.url + "/update_weights_from_disk", json={"model_path": "/nonexistent"})
        assert r.status_code == 400 and r.json()["success"] is False
        r = c.post(engine.url + "/destroy_weights_update_group", json={"group_name": "nope"})
        assert r.status_code == 400 and "does not exist" in r.json()["message"]
        assert c.get(engine.url + "/server_info").json()["version"] == "0.5.10"


def test_standin_fields_equal_sglang_0_5_10_io_struct():
    """The stand-in accepts exactly the request fields SGLang 0.5.10 declares (``sglang/srt/managers/io_struct.py``:
    each struct's dataclass fields plus ``BaseReq``'s ``rid`` and ``http_worker_ipc``; ``SamplingParams.__init__``'s
    arguments in ``sampling/sampling_params.py``), recorded here from the release: a change to either list is a
    deliberate edit of both. With ``SGLANG_SRC`` pointing at an unpacked 0.5.10 wheel the recording is checked too."""
    from tests.helpers import sglang_standin as standin

    assert standin.FIELDS == IO_STRUCT_0_5_10
    assert standin.SAMPLING == SAMPLING_PARAMS_0_5_10
    assert all(req <= set(standin.FIELDS[p]) for p, req in standin.REQUIRED.items())
    src = os.environ.get("SGLANG_SRC")
    if src:  # e.g. pip download --no-deps sglang==0.5.10; unzip the wheel; SGLANG_SRC=<that folder>/sglang
        assert read_io_struct(Path(src)) == IO_STRUCT_0_5_10


_BASE = ["rid", "http_worker_ipc"]
IO_STRUCT_0_5_10 = {  # endpoint -> fields of its request struct, in declaration order (BaseReq's first)
    "/generate": [*_BASE, "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data",
                  "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                  "return_text_in_logprobs", "stream", "log_metrics", "return_hidden_states", "return_routed_experts",
                  "routed_experts_start_len", "modalities", "session_params", "lora_path", "lora_id",
                  "custom_logit_processor", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                  "bootstrap_pair_key", "decode_tp_size", "require_reasoning", "routed_dp_rank",
                  "disagg_prefill_dp_rank", "data_parallel_rank", "background", "conversation_id", "priority",
                  "extra_key", "routing_key", "no_logs", "custom_labels", "return_bytes", "return_entropy",
                  "external_trace_header", "received_time", "need_wait_for_mm_inputs", "num_items_assigned",
                  "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch"],
    "/abort_request": [*_BASE, "abort_all", "finished_reason", "abort_message"],
    "/pause_generation": [*_BASE, "mode"],
    "/continue_generation": _BASE,
    "/update_weights_from_disk": [*_BASE, "model_path", "load_format", "abort_all_requests", "weight_version",
                                  "is_async", "torch_empty_cache", "keep_pause", "recapture_cuda_graph", "token_step",
                                  "flush_cache", "manifest"],
    "/init_weights_update_group": [*_BASE, "master_address", "master_port", "rank_offset", "world_size",
                                   "group_name", "backend"],
    "/destroy_weights_update_group": [*_BASE, "group_name"],
    "/update_weights_from_distributed": [*_BASE, "names", "dtypes", "shapes", "group_name", "flush_cache",
                                         "abort_all_requests", "weight_version", "load_format"],
    "/release_memory_occupation": [*_BASE, "tags"],
    "/resume_memory_occupation": [*_BASE, "tags"],
    "/load_lora_adapter": [*_BASE, "lora_name", "lora_path", "pinned", "lora_id"],
    "/unload_lora_adapter": [*_BASE, "lora_name", "lora_id"],
}
SAMPLING_PARAMS_0_5_10 = [
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed"]
STRUCTS = {"/generate": "GenerateReqInput", "/abort_request": "AbortReq",
           "/pause_generation": "PauseGenerationReqInput",
           "/continue_generation": "ContinueGenerationReqInput",
           "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
           "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
           "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
           "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
           "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
           "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
           "/load_lora_adapter": "LoadLoRAAdapterReqInput", "/unload_lora_adapter": "UnloadLoRAAdapterReqInput"}


def read_io_struct(src: Path) -> dict[str, list[str]]:
    """The fields of the request structs in an SGLang source tree's ``srt/managers/io_struct.py`` (read, not run)."""
    import ast

    tree = ast.parse((src / "srt/managers/io_struct.py").read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> list[str]:
        cls = classes[name]
        base = [b.id for b in cls.bases if isinstance(b, ast.Name) and b.id in classes]
        own = [a.target.id for a in cls.body if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)]
        return [f for b in base for f in fields(b)] + own

    return {path: fields(name) for path, name in STRUCTS.items()}


def test_logprobs_and_versions_from_meta_info(served, loop):
    engine, _, _, tok = served
    res = _gen(loop, engine, rid="lp", n=2, temperature=0.7, max_new_tokens=16)
    model = hf_model(folder=engine.setup.model_dir)
    for s in res.samples:
        assert len(s.token_ids) == len(s.logprobs) > 0 and (s.versions == 0).all()
        ref = recompute_logprobs(model, PROMPT, s.token_ids.tolist(), 0.7)
        np.testing.assert_allclose(s.logprobs, ref, atol=1e-5)
    g = _gen(loop, engine, rid="g", temperature=0.0, max_new_tokens=20).samples[0]
    assert g.token_ids.tolist() == hf_greedy(model, PROMPT, 20, tok.eos_token_id)


def test_longest_prompt_with_all_new_tokens_fits(served, loop):
    """A prompt of exactly ``data.max_prompt_tokens`` with ``max_new_tokens`` new tokens (the dataset keeps such
    prompts): SGLang refuses input + max_new_tokens >= its context length, so the engine gives the server one more
    token of context than the longest sample where the model's positions allow it, and caps a request's
    max_new_tokens to what fits where they do not (this tiny model has 256 positions = 16 + 240)."""
    engine, _, cfg, _ = served
    n_prompt, n_new = cfg.data.max_prompt_tokens, cfg.rollout.sampling.max_new_tokens
    assert engine.setup.max_model_len == n_prompt + n_new
    prompt = [1] + [5 + (i % 10) for i in range(n_prompt - 2)] + [17]
    s = _gen(loop, engine, prompt, rid="full", temperature=1.0, max_new_tokens=n_new).samples[0]
    assert 0 < len(s.token_ids) <= n_new and s.finish_reason in ("stop", "length")
    assert len(prompt) + len(s.token_ids) < engine.context_length


def test_context_length_is_one_more_than_the_longest_sample(tmp_path):
    """Where the model has positions to spare, ``--context-length`` is prompt + new tokens + 1 (so SGLang's
    ``>=`` check passes a full-length sample without capping it); never more than the model's positions."""
    from relax_hpc.config.schema import ServerConfig
    from relax_hpc.rollout.server.base import ServerSetup
    from relax_hpc.rollout.server.sglang import SGLangEngine

    folder = tmp_path / "m"
    folder.mkdir()
    for positions, want in ((2048, 257), (256, 256)):
        (folder / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
        engine = SGLangEngine(ServerConfig(), ServerSetup(name="x-0", model_dir=folder, record=tmp_path / "r.json",
                                                          log=tmp_path / "x.log", max_model_len=256))
        args = engine.server_args(folder, 1234)
        assert engine.context_length == want and args[args.index("--context-length") + 1] == str(want)


def test_seeded_request_refused_without_deterministic_inference(served, loop):
    """SGLang ignores ``sampling_seed`` unless the server runs with ``--enable-deterministic-inference``: a seeded
    request to such a server is refused in one line instead of silently not being reproducible."""
    from relax_hpc.rollout.server.base import ServerError

    engine, _, _, _ = served
    assert not engine.deterministic and "--enable-deterministic-inference" not in engine.server.spec.argv
    with pytest.raises(ServerError) as err:
        _gen(loop, engine, rid="seeded", temperature=1.0, max_new_tokens=4, seed=7)
    assert "--enable-deterministic-inference" in str(err.value) and "\n" not in str(err.value)


def test_server_version_read_and_logged(served):
    _, rd, _, _ = served
    ready = [e for e in _events(rd) if e.get("event") == "server_ready"]
    assert ready and ready[0]["server_version"] == "0.5.10" and "0.5.10" in ready[0]["message"]


@pytest.mark.parametrize("version,accepted,ok", [("0.4.9", None, False), ("0.6.0", None, False),
                                                 ("0.4.9", "", True), ("0.5.23", None, True)])
def test_server_version_outside_the_checked_range_refused(tmp_path, loop, version, accepted, ok):
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.rollout.server import make_server_engine
    from relax_hpc.rollout.server.process import ServerStartError

    rd = RunDir.create(tmp_path / "run")
    cfg = recipe("sglang", rd.root, command=f"{sys.executable} {STANDIN}", versions=accepted,
                 env={"PYTHONPATH": os.getcwd(), "SGLANG_STANDIN_VERSION": version})
    engine = make_server_engine(cfg, run_dir=rd, proc="rollout-0", device="cpu", seed=0,
                                tokenizer=build_digits_tokenizer())
    try:
        if ok:
            loop.run(engine.ensure_started(), timeout=120)
            assert engine.server.alive()
        else:
            with pytest.raises(ServerStartError) as err:
                loop.run(engine.ensure_started(), timeout=120)
            msg = str(err.value)
            assert "\n" not in msg and f"sglang {version} is outside" in msg and ">=0.5.10,<=0.5.23" in msg
            assert not engine.server.alive()
    finally:
        loop.run(engine.close())


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


def _broadcast(port: int, state: dict, done: list, group_name: str = "relax_weights") -> None:
    """Trainer rank 0's side (relax_hpc.weights.server_links.init_group: the group SGLang builds)."""
    import torch.distributed as dist

    from relax_hpc.weights.server_links import destroy_group, init_group

    pg = init_group("gloo", "127.0.0.1", port, rank=0, world_size=2, group_name=group_name, timeout_s=60)
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
    restarts, pid = engine.stats.server_restarts, engine.server.proc.pid
    loop.run(engine.pause(abort=True))
    loop.run(engine.receive(3, src), timeout=120)
    loop.run(engine.resume())
    assert engine.version == 3 and engine.stats.fallbacks >= 1
    # the fallback checked the paused server without a generation (SGLang's /health waits while paused): the
    # healthy server was kept, not stopped and restarted
    assert engine.stats.server_restarts == restarts and engine.server.proc.pid == pid
    assert not any(e.get("event") == "server_died" for e in _events(rd))
    fb = [e for e in _events(rd) if e.get("event") == "weight_sync_fallback"]
    assert fb and "version 3" in fb[-1]["message"] and "v3" in fb[-1]["message"]
    got = _gen(loop, engine, rid="fb", temperature=0.0, max_new_tokens=20, timeout=200).samples[0]
    assert got.token_ids.tolist() == hf_greedy(hf_model(state, folder=engine.setup.model_dir), PROMPT, 20,
                                               tok.eos_token_id)


def _standin_calls(rd: RunDir, path: str, code: int | None = None) -> int:
    """How many ``POST path`` requests the stand-in logged (answered ``code``, if given), across its restarts."""
    want = f'"POST {path} HTTP/1.1" ' + ("" if code is None else f"{code} ")
    return sum(want in line for line in rd.server_log("rollout-0-0").read_text().splitlines())


def test_health_while_paused(served, loop):
    """SGLang's /health generates a token, which cannot run while generation is paused (it answers 503 after 20 s):
    the engine asks /model_info instead while paused, so a paused healthy server is healthy."""
    engine, _, _, _ = served
    loop.run(engine.pause(abort=True))
    try:
        t0 = time.monotonic()
        h = loop.run(engine.health(), timeout=60)
        assert h.ok, h
        assert time.monotonic() - t0 < 5.0
        # the stand-in's /health itself waits while paused
        with httpx.Client(trust_env=False) as c, pytest.raises(httpx.TimeoutException):
            c.get(engine.url + "/health", timeout=2.5)
    finally:
        loop.run(engine.resume())
    assert loop.run(engine.health(), timeout=60).ok


def test_fast_path_failure_destroys_the_group(served, loop):
    """The trainer joins the group, then goes away without broadcasting: the server's receive fails (HTTP 400), the
    engine releases the server's group (``/destroy_weights_update_group``: a group left behind holds a dead
    communicator), forgets it, and loads the files."""
    from relax_hpc.rollout.server.base import DistributedSource, GroupInfo
    from relax_hpc.rollout.server.process import free_port
    from relax_hpc.weights.server_links import destroy_group, init_group

    engine, rd, _, tok = served
    _, state = _publish(rd, engine, engine.version + 1, seed=21)
    version = engine.version + 1
    metas = [[(k, "float32", list(v.shape)) for k, v in state.items()]]
    port = free_port()
    g = GroupInfo("127.0.0.1", port, world_size=2, backend="gloo", group_name="relax_weights_gone")

    def trainer_goes_away() -> None:
        destroy_group(init_group("gloo", "127.0.0.1", port, rank=0, world_size=2, group_name=g.group_name,
                                 timeout_s=60))

    th = threading.Thread(target=trainer_goes_away, daemon=True)
    th.start()
    destroyed, fallbacks, pid = _standin_calls(rd, "/destroy_weights_update_group", 200), engine.stats.fallbacks, \
        engine.server.proc.pid
    engine.cfg.sync_timeout_s = 20.0
    loop.run(engine.pause(abort=True))
    loop.run(engine.receive(version, DistributedSource(g, metas)), timeout=120)
    loop.run(engine.resume())
    th.join(30)
    assert engine.stats.fallbacks == fallbacks + 1 and engine.version == version and engine.server.proc.pid == pid
    assert _standin_calls(rd, "/destroy_weights_update_group", 200) == destroyed + 1
    assert engine._group is None
    got = _gen(loop, engine, rid="gone", temperature=0.0, max_new_tokens=20).samples[0]
    assert got.token_ids.tolist() == hf_greedy(hf_model(state, folder=engine.setup.model_dir), PROMPT, 20,
                                               tok.eos_token_id)


def test_fast_path_after_a_restart_initialises_the_group_again(served, loop):
    """A restarted server holds no weight-update group; SGLang asserts the group exists outside any ``try`` and
    dies. The engine forgets its group when a server starts, so the next update (same group address and name)
    initialises it again: no fallback, no second death."""
    from relax_hpc.rollout.server.base import DistributedSource, GroupInfo
    from relax_hpc.rollout.server.process import free_port

    engine, rd, _, tok = served
    port = free_port()
    g = GroupInfo("127.0.0.1", port, world_size=2, backend="gloo", group_name="relax_weights_same")
    engine.cfg.sync_timeout_s = 30.0
    inits = _standin_calls(rd, "/init_weights_update_group", 200)
    for step in range(2):
        version = engine.version + 1
        _, state = _publish(rd, engine, version, seed=30 + step)
        names = list(state)
        metas = [[(k, "float32", list(state[k].shape)) for k in names[:7]],
                 [(k, "float32", list(state[k].shape)) for k in names[7:]]]
        done: list = []
        th = threading.Thread(target=_broadcast, args=(port, state, done, g.group_name), daemon=True)
        th.start()
        fallbacks, restarts = engine.stats.fallbacks, engine.stats.server_restarts
        loop.run(engine.pause(abort=True))
        loop.run(engine.receive(version, DistributedSource(g, metas)), timeout=120)
        loop.run(engine.resume())
        th.join(30)
        assert done and engine.stats.fallbacks == fallbacks and engine.stats.server_restarts == restarts
        got = _gen(loop, engine, rid=f"rg{step}", temperature=0.0, max_new_tokens=20).samples[0]
        assert got.token_ids.tolist() == hf_greedy(hf_model(state, folder=engine.setup.model_dir), PROMPT, 20,
                                                   tok.eos_token_id)
        assert (got.versions == version).all()
        if step == 0:  # the server dies between the two updates and is restarted by the next request
            pid = engine.server.proc.pid
            os.killpg(pid, signal.SIGKILL)
            engine.server.proc.wait(10)
            _gen(loop, engine, rid="rg-restart", temperature=0.0, max_new_tokens=3, timeout=200)
            assert engine.server.proc.pid != pid
    assert _standin_calls(rd, "/init_weights_update_group", 200) == inits + 2


def test_hold_pause_leaves_nothing_in_the_running_batch(served, loop):
    """The engine never sends SGLang's ``in_place`` pause: requests it holds stay in the running batch, and the cache
    flush of the next weight update fails an assert that takes the scheduler down. Retried until the pause lands
    while the request generates (it may finish first on a fast machine)."""
    engine, rd, _, _ = served
    reasons = []
    for attempt in range(8):
        folder, _ = _publish(rd, engine, engine.version + 1, seed=41 + attempt)
        view = engine._loadable(folder)
        req = GenerateRequest(request_id=f"held{attempt}", prompt_ids=[1, 5 + attempt % 9, 6, 17],
                              sampling=SamplingParams(temperature=1.0, max_new_tokens=240))
        fut = loop.submit(engine.generate(req))
        deadline = time.monotonic() + 30
        while not engine._calls and time.monotonic() < deadline:
            time.sleep(0.002)
        pid = engine.server.proc.pid
        loop.run(engine._server_pause(False), timeout=60)  # what pause(abort=False) asks of the server
        loop.run(engine._load_folder(view, engine.version + 1), timeout=120)
        engine.version += 1
        loop.run(engine._server_resume())
        assert engine.server.alive() and engine.server.proc.pid == pid
        reasons.append(fut.result(120).samples[0].finish_reason)
        if reasons[-1] == "abort":
            break
    assert "abort" in reasons, reasons


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
        with pytest.raises(ValueError, match="takes no module"):
            make_engine(cfg, tokenizer=tok, device="cpu", run_dir=rd, model=object())
        with pytest.raises(ValueError, match="needs the run dir"):
            make_engine(cfg, tokenizer=tok, device="cpu")



def test_engine_sends_only_fields_sglang_declares(tmp_path, loop):
    """Against the stand-in's strict mode (an unknown body field or sampling parameter is answered 400, where SGLang
    itself would ignore a misspelled field or fail with 500), every request the engine makes: generation with every
    sampling setting it sends, seeded (the server started with --enable-deterministic-inference, so equal seeds give
    equal samples), abort, the pauses, a weight update from the files, one over the fast path and a failed one (the
    group released)."""
    from relax_hpc.events import EventLog
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.rollout.server import make_server_engine
    from relax_hpc.rollout.server.base import DistributedSource, GroupInfo
    from relax_hpc.rollout.server.partial import generate_resumable, update_weights
    from relax_hpc.rollout.server.process import free_port

    rd = RunDir.create(tmp_path / "run")
    cfg = recipe("sglang", rd.root, command=f"{sys.executable} {STANDIN}", sync_timeout_s=20,
                 env={"PYTHONPATH": os.getcwd(), "SGLANG_STANDIN_STRICT": "1"})
    cfg.rollout.sglang.server_args = {"enable_deterministic_inference": True}
    events = EventLog(rd, "rollout", 0)
    engine = make_server_engine(cfg, run_dir=rd, proc="rollout-0", device="cpu", seed=0,
                                tokenizer=build_digits_tokenizer(), events=events)
    try:
        loop.run(engine.ensure_started(), timeout=120)
        assert engine.deterministic and "--enable-deterministic-inference" in engine.server.spec.argv
        kw = {"temperature": 0.9, "top_p": 0.9, "top_k": 5, "max_new_tokens": 12, "stop": ["9"],
              "stop_token_ids": [3], "n": 2, "seed": 11}
        a, b = (_gen(loop, engine, rid=f"s{k}", **kw).samples for k in range(2))
        assert [x.token_ids.tolist() for x in a] == [x.token_ids.tolist() for x in b]
        fut = loop.submit(engine.generate(GenerateRequest(request_id="ab", prompt_ids=PROMPT,
                                                          sampling=SamplingParams(temperature=0.0,
                                                                                  max_new_tokens=240))))
        time.sleep(0.3)
        loop.run(engine.abort(["ab"]))
        loop.run(engine.abort())
        fut.result(60)
        folder, _ = _publish(rd, engine, 1, seed=51)
        req = GenerateRequest(request_id="hold", prompt_ids=PROMPT, sampling=SamplingParams(temperature=0.0,
                                                                                           max_new_tokens=60))
        fut = loop.submit(generate_resumable(engine, req, max_resubmits=3))
        time.sleep(0.2)
        loop.run(update_weights(engine, 1, SnapshotFolder(folder), partial_rollout=True))
        fut.result(120)
        _, state = _publish(rd, engine, 2, seed=52)
        port = free_port()
        done: list = []
        th = threading.Thread(target=_broadcast, args=(port, state, done), daemon=True)
        th.start()
        metas = [[(k, "float32", list(v.shape)) for k, v in state.items()]]
        loop.run(engine.pause(abort=False))
        loop.run(engine.receive(2, DistributedSource(GroupInfo("127.0.0.1", port, world_size=2, backend="gloo"),
                                                     metas)), timeout=120)
        loop.run(engine.resume())
        th.join(30)
        assert done and engine.stats.fallbacks == 0 and engine.version == 2
        _publish(rd, engine, 3, seed=53)
        engine.cfg.sync_timeout_s = 4.0
        g = GroupInfo("127.0.0.1", free_port(), world_size=2, backend="gloo", group_name="nobody")
        loop.run(engine.receive(3, DistributedSource(g, metas)), timeout=120)
        assert engine.stats.fallbacks == 1 and engine.version == 3
        log = rd.server_log("rollout-0-0").read_text()
        assert '"POST /destroy_weights_update_group HTTP/1.1"' in log and '" 400 ' in log  # that group never formed
        assert not [line for line in log.splitlines() if '" 400 ' in line and "destroy_weights" not in line]
    finally:
        loop.run(engine.close())
        events.close()
