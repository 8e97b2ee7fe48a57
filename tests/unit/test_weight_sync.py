"""A rollout worker's weight pick-up through the engine's sink, with real processes: the first weights come from the
snapshot files, the next over the gloo fast path (:class:`FastPathStream` -> ``engine.receive``), bit for bit what the
files hold; the engine holds its own model (loaded from the recipe, as in a fully_async worker)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from relax_hpc.rundir import RunDir

CFG = {"data": {"task": {"name": "reverse_digits"}}, "model": {"path": "tiny"}, "rollout": {"device": "cpu"}}

WORKER = textwrap.dedent("""
    import asyncio, json, sys, time, torch
    from relax_hpc.config.load import validate_dict
    from relax_hpc.models.load import load_tokenizer
    from relax_hpc.rollout.factory import make_engine
    from relax_hpc.rollout.weight_sync import FastPathStream, WeightSync
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights import SnapshotReader
    from relax_hpc.weights.fastpath import FastPathClient
    rd = RunDir(sys.argv[1])
    cfg = validate_dict(json.loads(sys.argv[2]))
    engine = make_engine(cfg, seed=0, tokenizer=load_tokenizer(cfg.model))
    stream = FastPathStream(FastPathClient(rd, 0, join_timeout_s=60), engine.weight_template())
    sync = WeightSync(rd, engine, reader="rollout-0", fast=stream)
    loop = asyncio.new_event_loop()

    def report(path):
        want = SnapshotReader(rd, name="check").load(engine.version).state_dict
        same = all(torch.equal(v, want[k]) for k, v in engine.model.state_dict().items())
        print(json.dumps({"version": engine.version, "path": path, "bitwise_equal": same}), flush=True)

    _, path = loop.run_until_complete(sync.update(files_first=True))
    report(path)
    input()  # version 2 is handed to the fast path now
    for _ in range(400):
        got = loop.run_until_complete(sync.pull_fast())
        if got is not None and got >= 2:
            break
        time.sleep(0.05)
    report("fast" if engine.version == 2 else "none")
    sync.close()
    loop.run_until_complete(engine.close())
""")


def test_first_weights_from_files_then_over_the_fast_path(tmp_path: Path) -> None:
    from relax_hpc.config.load import validate_dict
    from relax_hpc.models.load import load_model, load_tokenizer
    from relax_hpc.weights import SnapshotPublisher
    from relax_hpc.weights.fastpath import FastPathServer

    cfg = validate_dict(CFG)
    rd = RunDir.create(tmp_path / "run")
    model = load_model(cfg.model, load_tokenizer(cfg.model), device="cpu", dtype=torch.float32)
    pub = SnapshotPublisher(rd)
    pub.publish(model.state_dict(), version=1, step=1)
    server = FastPathServer(rd, 1, timeout_s=120)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(rd.root), json.dumps(CFG)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = worker.stdout.readline()
        assert first, worker.stderr.read()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # "training"
        pub.publish(model.state_dict(), version=2, step=2)
        server.update(2, model.state_dict())
        worker.stdin.write("\n")
        worker.stdin.flush()
        second = worker.stdout.readline()
        assert second, worker.stderr.read()
        assert worker.wait(timeout=120) == 0, worker.stderr.read()
    finally:
        server.close()
        if worker.poll() is None:
            worker.kill()
    assert json.loads(first) == {"version": 1, "path": "file", "bitwise_equal": True}
    assert json.loads(second) == {"version": 2, "path": "fast", "bitwise_equal": True}
    assert server.sent.get(0, 0) >= 1  # really went over the link
