"""The weight fast path: a rollout worker process receives new weights over its gloo link, bit for bit the same as
what it would load from the snapshot on disk; a broken link falls back to the files."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from relax_hpc.config.schema import TinyModelConfig
from relax_hpc.models.tiny import build_tiny_model
from relax_hpc.rundir import RunDir
from relax_hpc.weights import SnapshotPublisher
from relax_hpc.weights.fastpath import FastPathClient, FastPathServer

WORKER = textwrap.dedent("""
    import json, sys, time, torch
    from relax_hpc.config.schema import TinyModelConfig
    from relax_hpc.models.tiny import build_tiny_model
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights import SnapshotReader
    from relax_hpc.weights.fastpath import FastPathClient
    rd = RunDir(sys.argv[1])
    fast_model = build_tiny_model(TinyModelConfig(), 18, seed=123)
    file_model = build_tiny_model(TinyModelConfig(), 18, seed=456)
    client = FastPathClient(rd, 0, join_timeout_s=60)
    got = []
    for want in (1, 2):
        v = None
        deadline = time.monotonic() + 60  # the trainer may publish late (a loaded machine): wait by time, not tries
        while time.monotonic() < deadline:
            v = client.pull(got[-1] if got else -1, fast_model)
            if v is not None and v >= want:
                break
            time.sleep(0.01)
        got.append(v)
        SnapshotReader(rd, name="rollout-0").load_into(file_model, v)
        same = all(torch.equal(a, b) for a, b in zip(fast_model.state_dict().values(),
                                                     file_model.state_dict().values()))
        print(json.dumps({"version": v, "bitwise_equal": same}), flush=True)
        input()  # wait for the next version
    client.close()
""")


@pytest.mark.parametrize("late_s", [0.0, 1.0])
def test_fast_path_matches_snapshot_bit_for_bit(tmp_path: Path, late_s: float) -> None:
    """``late_s``: the trainer hands over the next version that long after the worker starts waiting for it (a loaded
    machine). The worker used to give up after 200 pulls that do not wait (a few ms), keeping version 1."""
    rd = RunDir.create(tmp_path / "run")
    model = build_tiny_model(TinyModelConfig(), 18, seed=0)
    pub = SnapshotPublisher(rd)
    server = FastPathServer(rd, 1, timeout_s=120)
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(rd.root)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        results = []
        for version in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.1)  # "training"
            sd = model.state_dict()
            pub.publish(sd, version=version, step=version)
            server.update(version, sd)
            line = worker.stdout.readline()
            assert line, worker.stderr.read()
            results.append(json.loads(line))
            worker.stdin.write("\n")
            worker.stdin.flush()
            time.sleep(late_s)
        assert worker.wait(timeout=120) == 0, worker.stderr.read()
    finally:
        server.close()
        if worker.poll() is None:
            worker.kill()
    assert [r["version"] for r in results] == [1, 2]
    assert all(r["bitwise_equal"] for r in results)
    assert server.sent.get(0, 0) >= 2  # really went over the link


def test_client_without_server_falls_back(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    client = FastPathClient(rd, 3, join_timeout_s=1.0, retry_s=60)
    model = build_tiny_model(TinyModelConfig(), 18, seed=0)
    assert client.pull(-1, model) is None  # nobody serves: the caller loads the snapshot from the files
    assert client.pull(-1, model) is None  # and does not retry at once


MISMATCHED_WORKER = textwrap.dedent("""
    import json, sys
    from relax_hpc.config.schema import TinyModelConfig
    from relax_hpc.models.tiny import build_tiny_model
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights.fastpath import FastPathClient
    import time, torch
    model = build_tiny_model(TinyModelConfig(), 20, seed=1)  # another vocabulary: other embedding shapes
    before = {k: v.clone() for k, v in model.state_dict().items()}
    client = FastPathClient(RunDir(sys.argv[1]), 0, join_timeout_s=60)
    pulled = -1
    for _ in range(600):  # over gloo the trainer pushes: a pull returns -1 until the header arrived
        pulled = client.pull(-1, model)
        if pulled != -1:
            break
        time.sleep(0.05)
    same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    print(json.dumps({"pulled": pulled, "unchanged": same}), flush=True)
""")


def test_mismatched_model_is_refused_and_falls_back(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    model = build_tiny_model(TinyModelConfig(), 18, seed=0)
    server = FastPathServer(rd, 1, timeout_s=120)
    server.update(1, model.state_dict())
    worker = subprocess.run([sys.executable, "-c", MISMATCHED_WORKER, str(rd.root)], capture_output=True, text=True,
                            timeout=120)
    server.close()
    assert worker.returncode == 0, worker.stderr
    # refused: the worker loads the files instead, and its weights were not touched
    assert json.loads(worker.stdout.strip().splitlines()[-1]) == {"pulled": None, "unchanged": True}
    assert "differ from this worker's model" in worker.stderr


CUDA_WORKER = textwrap.dedent("""
    import json, sys, time, torch
    from relax_hpc.config.schema import TinyModelConfig
    from relax_hpc.models.tiny import build_tiny_model
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights.fastpath import FastPathClient
    model = build_tiny_model(TinyModelConfig(), 18, seed=1).cuda()
    client = FastPathClient(RunDir(sys.argv[1]), 0, device="cuda", join_timeout_s=60)
    v = -1
    for _ in range(600):
        v = client.pull(-1, model)
        if v is not None and v >= 1:
            break
        time.sleep(0.05)
    torch.save({k: t.cpu() for k, t in model.state_dict().items()}, sys.argv[2])
    print(json.dumps({"version": v, "device": str(next(model.parameters()).device)}), flush=True)
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_worker_joins_a_gloo_link_through_host_memory(tmp_path: Path) -> None:
    # the trainer's link is gloo (weights.fast_path: gloo, or a CPU trainer): a GPU worker joins it and copies the
    # host buffers into its GPU weights
    rd = RunDir.create(tmp_path / "run")
    model = build_tiny_model(TinyModelConfig(), 18, seed=0)
    server = FastPathServer(rd, 1, device="cpu", timeout_s=120)
    server.update(1, model.state_dict())
    out = tmp_path / "got.pt"
    worker = subprocess.run([sys.executable, "-c", CUDA_WORKER, str(rd.root), str(out)], capture_output=True,
                            text=True, timeout=300)
    server.close()
    assert worker.returncode == 0, worker.stderr[-3000:]
    assert json.loads(worker.stdout.strip().splitlines()[-1]) == {"version": 1, "device": "cuda:0"}
    got = torch.load(out)
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
