"""Sleep and wake of a server engine (colocate, ``rollout.server.sleep_level``) against the SGLang stand-in
(``tests/helpers/sglang_standin.py``: a real HTTP server process serving SGLang 0.5.10's
``/release_memory_occupation`` and ``/resume_memory_occupation``; its memory saver fills released weights with NaN,
as their pages hold garbage after a real release).

The state machine of :class:`relax_hpc.rollout.server.base.ServerEngine`: a level-2 sleep discards the weights, so a
version must be received between ``wake(weights_only=True)`` and ``wake()``; a level-1 sleep brings them back; no
generation or weight load while asleep; a restarted server is awake.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.rollout.engine import GenerateRequest, SamplingParams, SnapshotFolder
from relax_hpc.rollout.server.base import ServerError
from relax_hpc.rundir import RunDir
from tests.helpers.server_util import hf_model, recipe, recompute_logprobs

pytestmark = [pytest.mark.integration]

STANDIN = Path(__file__).parents[1] / "helpers" / "sglang_standin.py"
PROMPT = [1, 5, 6, 7, 17]


def _engine(rd: RunDir, level: int, name: str):
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.rollout.server import make_server_engine

    cfg = recipe("sglang", rd.root, command=f"{sys.executable} {STANDIN}", restart_backoff_s=0.2,
                 env={"PYTHONPATH": os.getcwd(), "SGLANG_STANDIN_STRICT": "1"})  # a field SGLang lacks: 400
    server = cfg.rollout.server.model_copy(update={"sleep_level": level})
    cfg = cfg.model_copy(update={"mode": "colocate", "rollout": cfg.rollout.model_copy(update={"server": server})})
    return make_server_engine(cfg, run_dir=rd, proc=name, device="cpu", seed=0, tokenizer=build_digits_tokenizer())


@pytest.fixture(scope="module")
def level2(tmp_path_factory, loop):
    rd = RunDir.create(tmp_path_factory.mktemp("sleep") / "run")
    engine = _engine(rd, 2, "colocate-0")
    loop.run(engine.ensure_started(), timeout=120)
    yield engine
    loop.run(engine.close(), timeout=60)


def _gen(loop, engine, rid="r"):
    req = GenerateRequest(request_id=rid, prompt_ids=PROMPT, sampling=SamplingParams(temperature=1.0, max_new_tokens=6))
    return loop.run(engine.generate(req), timeout=120).samples[0]


def _argv(engine) -> list[str]:
    return engine.server.spec.argv


def test_level2_discards_weights_and_loads_the_new_version_between_the_wakes(level2, loop):
    engine = level2
    assert engine.can_sleep and "--enable-memory-saver" in _argv(engine)
    assert "--enable-weights-cpu-backup" not in _argv(engine) and "--mem-fraction-static" in _argv(engine)
    _gen(loop, engine, "before")
    loop.run(engine.sleep(2))
    with pytest.raises(ServerError, match="is asleep"):
        _gen(loop, engine, "asleep")
    with pytest.raises(ServerError, match="wake\\(weights_only=True\\) before"):  # its weights' memory is away
        loop.run(engine.receive(1, SnapshotFolder(engine.setup.model_dir, verify="none")))
    loop.run(engine.wake(weights_only=True))
    with pytest.raises(ServerError, match="discarded its weights"):  # the KV cache back on garbage weights: refused
        loop.run(engine.wake())
    loop.run(engine.receive(1, SnapshotFolder(engine.setup.model_dir, verify="none")))
    loop.run(engine.wake())
    s = _gen(loop, engine, "after")
    assert engine.version == 1 and (s.versions == 1).all()
    ref = recompute_logprobs(hf_model(folder=engine.setup.model_dir), PROMPT, s.token_ids.tolist(), 1.0)
    np.testing.assert_allclose(s.logprobs, ref, atol=1e-5)  # the loaded weights, not the NaN of the release
    assert engine.metrics()["rollout/server_sleeps"] == 1.0
    log = engine.setup.log.read_text()
    assert "released memory ['cuda_graph', 'kv_cache', 'weights'] (memory saver on)" in log
    assert "resumed memory ['weights']" in log and "resumed memory ['cuda_graph', 'kv_cache']" in log


def test_waking_an_awake_engine_does_nothing(level2, loop):
    loop.run(level2.wake())  # awake: no request to the server
    loop.run(level2.wake(weights_only=True))
    assert "KeyError" not in level2.setup.log.read_text()  # resuming a tag never released would kill SGLang


def test_server_killed_asleep_comes_back_awake(level2, loop):
    """A server that dies while asleep is restarted (awake, at the newest weights); the wake calls then do nothing
    on the new server, and it generates."""
    import signal

    engine = level2
    loop.run(engine.sleep(2))
    old = engine.server.proc.pid
    os.killpg(old, signal.SIGKILL)
    engine.server.proc.wait(10)
    loop.run(engine.wake(weights_only=True), timeout=120)  # finds it dead: restart, then nothing to wake
    loop.run(engine.wake(), timeout=120)
    assert engine.server.proc.pid != old and engine.stats.server_restarts == 1
    assert np.isfinite(_gen(loop, engine, "restarted").logprobs).all()


def test_level1_keeps_the_weights_in_host_memory(tmp_path, loop):
    engine = _engine(RunDir.create(tmp_path / "run"), 1, "colocate-1")
    try:
        loop.run(engine.ensure_started(), timeout=120)
        assert "--enable-weights-cpu-backup" in _argv(engine)
        loop.run(engine.sleep(1))
        loop.run(engine.wake())  # no new version: the backup comes back
        s = _gen(loop, engine, "l1")
        ref = recompute_logprobs(hf_model(folder=engine.setup.model_dir), PROMPT, s.token_ids.tolist(), 1.0)
        np.testing.assert_allclose(s.logprobs, ref, atol=1e-5)
    finally:
        loop.run(engine.close(), timeout=60)


def test_colocate_demo_on_the_sglang_standin(tmp_path: Path) -> None:
    """``relax-hpc submit`` in mode colocate with ``rollout.engine: sglang`` (the stand-in as the server command):
    after each generation the server releases its memory (level 2: the stand-in's weights become NaN), after the
    optimizer step it resumes the weights' memory, loads the new version's files, resumes the rest; the trainer's
    recomputed log-probs equal the server's (it generated with the trainer's weights at every step)."""
    from tests.helpers.runutil import DEMO, cli, metrics

    run = tmp_path / "run"
    sets = ["rollout.engine=sglang", "num_steps=2", "warmup.steps=0", "rollout.server.startup_timeout_s=120",
            f"rollout.server.command={sys.executable} {STANDIN}", f"rollout.server.env.PYTHONPATH={os.getcwd()}"]
    args = ["submit", str(DEMO), "--executor", "local", "--run-dir", str(run)]
    for s in sets:
        args += ["--set", s]
    proc = cli(*args, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    ms = [m["metrics"] for m in metrics(run, "colocate-0") if "rollout/reward" in m["metrics"]]
    assert [m["weights/version"] for m in ms] == [1.0, 2.0]
    for m in ms:
        assert m["perf/sleep_s"] > 0 and m["perf/wake_s"] > 0
        assert m["train/logprob_abs_diff_max"] < 1e-4, m["train/logprob_abs_diff_max"]
    log = (run / "logs" / "server-colocate-0-0.log").read_text()
    assert log.count("released memory ['cuda_graph', 'kv_cache', 'weights'] (memory saver on)") == 2
    assert log.count("resumed memory ['weights']") == 2 and log.count("resumed memory ['cuda_graph', 'kv_cache']") == 2
