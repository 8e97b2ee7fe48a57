"""The ``vllm`` engine's fast path as vLLM 0.32 expects it, without NCCL: vLLM's weight-transfer engine cannot run
on the CPU build, so its request sequence goes to ``tests/helpers/vllm_rl_recorder.py`` (run by the vLLM venv's Python:
every ``init_info`` / ``update_info`` is built into vLLM's own dataclasses there). Checked: one
``/init_weight_transfer_engine`` per group and server process (again only after a restart), ``packed`` and the buffer
geometry stated, ``world_size`` against the server's DP x TP x PP, a failure shutting the group down, the server's
version read and checked. The fallback to the files on the real CPU server is in test_engine_vllm.py; the trainer's
end (``relax_hpc.weights.vllm_transfer``) is checked here for what it does without CUDA and vLLM. Skipped without the
vLLM venv unless ``RELAX_REQUIRE_VLLM=1``."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from relax_hpc.rollout.server.vllm import vllm_venv_python
from relax_hpc.rundir import RunDir
from tests.helpers.server_util import skip_module_without_vllm

pytestmark = [pytest.mark.integration]

RECORDER = Path(__file__).parents[1] / "helpers" / "vllm_rl_recorder.py"

skip_module_without_vllm()


def _engine(tmp: Path, *extra: str, **server: object):
    from relax_hpc.config.schema import ServerConfig
    from relax_hpc.rollout.server.base import ServerSetup
    from relax_hpc.rollout.server.vllm import VLLMEngine

    model = tmp / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}))
    rd = RunDir.create(tmp / "run")
    cfg = ServerConfig(command=f"{vllm_venv_python()} {RECORDER}", weight_sync="distributed", extra_args=list(extra),
                       startup_timeout_s=300, stop_grace_s=3, sync_timeout_s=400, restart_backoff_s=0.2,
                       **server)  # type: ignore[arg-type]
    setup = ServerSetup(name="rollout-0-0", model_dir=model, record=rd.server_record("rollout-0-0"),
                        log=rd.server_log("rollout-0-0"), device="cpu", max_model_len=64)
    return VLLMEngine(cfg, setup), rd


def _records(rd: RunDir, path: str) -> list[dict]:
    out = []
    for line in rd.server_log("rollout-0-0").read_text().splitlines():
        if line.startswith("RECORD "):
            rec = json.loads(line[7:])
            if rec["path"] == path:
                out.append(rec)
    return out


def _source(world_size: int, port: int = 29555):
    from relax_hpc.rollout.server.base import DistributedSource, GroupInfo

    metas = [[("model.embed_tokens.weight", "float32", [24, 8])], [("lm_head.weight", "bfloat16", [24, 8])]]
    return DistributedSource(GroupInfo("127.0.0.1", port, world_size=world_size), metas)


def test_one_init_per_group_and_server_across_updates_and_a_restart(tmp_path, loop):
    engine, rd = _engine(tmp_path)
    try:
        loop.run(engine.ensure_started(), timeout=400)
        for v in (1, 2):
            loop.run(engine.receive(v, _source(2)), timeout=400)
        assert len(_records(rd, "/init_weight_transfer_engine")) == 1
        pid = engine.server.proc.pid
        os.killpg(pid, signal.SIGKILL)
        engine.server.proc.wait(10)
        loop.run(engine.pause(abort=True), timeout=400)  # finds the server dead: restarts it
        loop.run(engine.resume(), timeout=60)
        assert engine.server.proc.pid != pid and engine.stats.server_restarts == 1
        loop.run(engine.receive(3, _source(2)), timeout=400)
        inits = _records(rd, "/init_weight_transfer_engine")
        assert len(inits) == 2 and engine.stats.fallbacks == 0 and engine.version == 3
        for rec in inits:
            info = rec["body"]["init_info"]
            assert info["packed"] is True and info["packed_buffer_size_bytes"] == 1 << 30
            assert info["packed_num_buffers"] == 2 and info["world_size"] == 2 and info["rank_offset"] == 1
        assert len(_records(rd, "/start_weight_update")) == 3 and len(_records(rd, "/update_weights")) == 6
        assert [r["body"]["weight_version"] for r in _records(rd, "/finish_weight_update")] == ["1", "2", "3"]
        assert _records(rd, "/update_weights")[1]["body"]["update_info"]["dtype_names"] == ["bfloat16"]
        # a new group (the link's next generation): the old one is shut down first, the new one initialised once
        loop.run(engine.receive(4, _source(2, port=29556)), timeout=400)
        loop.run(engine.receive(5, _source(2, port=29556)), timeout=400)
        assert len(_records(rd, "/init_weight_transfer_engine")) == 3
        assert len(_records(rd, "/shutdown_weight_transfer_engine")) == 1
        assert engine.transfer_ranks() == 1
    finally:
        loop.run(engine.close(), timeout=60)


def test_world_size_from_the_servers_parallel_layout(tmp_path, loop):
    """A server with 2 data-parallel ranks joins the group with 2 ranks: the group's world size must be 3; a group
    announced with 2 (TP only) is refused before any request to the server (the engine then loads the files)."""
    from relax_hpc.rollout.server.base import ServerError

    engine, rd = _engine(tmp_path, "--data-parallel-size", "2")
    try:
        loop.run(engine.ensure_started(), timeout=400)
        assert engine.transfer_ranks() == 2
        with pytest.raises(ServerError, match=r"world_size 2.*DP x TP x PP.*make 3"):
            loop.run(engine._load_distributed(_source(2), 1), timeout=60)
        assert _records(rd, "/init_weight_transfer_engine") == []
        loop.run(engine._load_distributed(_source(3), 1), timeout=400)
        assert _records(rd, "/init_weight_transfer_engine")[0]["body"]["init_info"]["world_size"] == 3
    finally:
        loop.run(engine.close(), timeout=60)


def test_failed_update_shuts_the_group_down_and_falls_back(tmp_path, loop):
    """The server lost its group behind the engine's back (here: shut down directly): the next update fails (HTTP
    500 from /start_weight_update), the engine shuts the group down, forgets it, loads the same version from the
    files (event ``weight_sync_fallback``), and the update after that initialises the group again."""
    from relax_hpc.events import EventLog
    from relax_hpc.rollout.engine import SnapshotFolder

    engine, rd = _engine(tmp_path)
    events = EventLog(rd, "rollout", 0)
    snap = tmp_path / "snap-v2"
    snap.mkdir()
    (snap / "config.json").write_text((engine.setup.model_dir / "config.json").read_text())
    engine.setup.events = events
    engine.setup.newest = lambda: (2, SnapshotFolder(snap, verify="none"))
    try:
        loop.run(engine.ensure_started(), timeout=400)
        loop.run(engine.receive(1, _source(2)), timeout=400)
        loop.run(engine._json("POST", "/shutdown_weight_transfer_engine"))
        shutdowns = len(_records(rd, "/shutdown_weight_transfer_engine"))
        loop.run(engine.receive(2, _source(2)), timeout=400)
        assert engine.stats.fallbacks == 1 and engine.version == 2 and engine._transfer is None
        assert len(_records(rd, "/shutdown_weight_transfer_engine")) == shutdowns + 1
        assert _records(rd, "/collective_rpc")[-1]["body"]["kwargs"]["weights_path"] == str(snap)
        evs = [json.loads(x) for x in rd.event_log("rollout-0").read_text().splitlines()]
        fb = [e for e in evs if e.get("event") == "weight_sync_fallback"]
        assert len(fb) == 1 and "HTTP 500" in fb[0]["message"] and "v2" in fb[0]["message"]
        loop.run(engine.receive(3, _source(2)), timeout=400)
        assert len(_records(rd, "/init_weight_transfer_engine")) == 2 and engine.stats.fallbacks == 1
    finally:
        loop.run(engine.close(), timeout=60)
        events.close()


@pytest.mark.parametrize("version,accepted,ok", [("0.31.2", None, False), ("0.33.0", None, False),
                                                 ("0.31.2", ">=0.31", True)])
def test_server_version_checked_at_start(tmp_path, loop, version, accepted, ok):
    from relax_hpc.rollout.server.process import ServerStartError

    engine, _ = _engine(tmp_path, versions=accepted, env={"VLLM_RECORDER_VERSION": version})
    try:
        if ok:
            loop.run(engine.ensure_started(), timeout=400)
            assert engine.server.alive()
        else:
            with pytest.raises(ServerStartError) as err:
                loop.run(engine.ensure_started(), timeout=400)
            assert "\n" not in str(err.value) and f"vllm {version} is outside" in str(err.value)
            assert ">=0.32,<0.33" in str(err.value) and not engine.server.alive()
    finally:
        loop.run(engine.close(), timeout=60)


def test_trainer_end_refuses_without_cuda_or_vllm(tmp_path):
    """The trainer's end of vLLM's weight transfer needs a CUDA device and the vllm package: without either, no
    link is served and one ``weight_sync_files`` event says why (the servers load the files)."""
    from relax_hpc.events import EventLog
    from relax_hpc.weights.vllm_transfer import unavailable, vllm_links
    from tests.helpers.server_util import recipe

    rd = RunDir.create(tmp_path / "run")
    cfg = recipe("vllm", rd.root, weight_sync="distributed")
    assert "CUDA" in (unavailable("cpu") or "")
    events = EventLog(rd, "trainer", 0)
    try:
        assert vllm_links(rd, cfg, device="cpu", events=events) is None
    finally:
        events.close()
    evs = [json.loads(x) for x in rd.event_log("trainer-0").read_text().splitlines()]
    files = [e for e in evs if e.get("event") == "weight_sync_files"]
    assert len(files) == 1 and "CUDA" in files[0]["message"]
    assert not rd.rendezvous_file("servers-0").exists()
