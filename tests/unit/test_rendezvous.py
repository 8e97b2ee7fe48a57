"""The fast-path rendezvous: real processes form a gloo group through a run dir, beside their own default groups."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from relax_hpc.errors import WaitTimeout
from relax_hpc.rendezvous import RendezvousInfo, broadcast_state_dict, form_group
from relax_hpc.rundir import RunDir

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import sys
import torch
import torch.distributed as dist
torch.set_num_threads(1)
from relax_hpc.errors import RelaxError
from relax_hpc.rendezvous import broadcast_state_dict, form_group, rendezvous_store

run, rank = sys.argv[1], int(sys.argv[2])
if rank < 2:  # ranks 0 and 1 are "trainer ranks" with a default group of their own (world 2); rank 2 has none
    store = rendezvous_store(run, "trainer", rank=rank, world_size=2, timeout_s=60)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)


def model(seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(64, 64, generator=g).bfloat16(),   # 8 KB: bigger than a bucket, sent as is
        "big.fp32": torch.randn(40, 40, generator=g),          # 6.4 KB
        "norm.a": torch.randn(16, generator=g), "norm.b": torch.randn(16, generator=g),
        "count": torch.tensor(123456789012, dtype=torch.int64),
        "mask": torch.rand(33, generator=g) > 0.5,
        "t": torch.randn(6, 8, generator=g),
        "empty": torch.zeros(0, 3),
        "half": torch.randn(5, 3, generator=g).half(),
    }


group = form_group(run, "weights", rank=rank, world_size=3, timeout_s=60)
x = torch.arange(5.0) if rank == 0 else torch.zeros(5)
group.broadcast(x, src=0)
assert torch.equal(x, torch.arange(5.0)), x
y = torch.tensor([rank + 1.0])
group.all_reduce(y)
assert y.item() == 6.0, y
if rank < 2:  # the default group is untouched and still its own world
    z = torch.tensor([10.0 * (rank + 1)])
    dist.all_reduce(z)
    assert z.item() == 30.0 and dist.get_world_size() == 2, (z, dist.get_world_size())
group.barrier()

if rank == 0:
    sd = model(7)
else:
    sd = {k: torch.zeros_like(v) for k, v in model(7).items()}
    sd["t"] = torch.zeros(8, 6).t()  # a non-contiguous receiver
keep = sd["embed"]
nbytes = broadcast_state_dict(group, sd, src=0, bucket_bytes=4096)
assert sd["embed"] is keep
for k, v in model(7).items():
    got = sd[k].contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(got, v.reshape(-1).view(torch.uint8)), k

bad = {"a": torch.zeros(3 if rank != 2 else 4)}
try:
    broadcast_state_dict(group, bad)
    mismatch = "none"
except RelaxError as exc:
    mismatch = "self" if "this rank differs" in str(exc) else "other"
group.close()
if rank < 2:
    dist.destroy_process_group()
print("ok", rank, group.generation, nbytes, mismatch, flush=True)
"""


def test_three_processes_form_a_group_beside_their_default_group(tmp_path):
    rd = RunDir.create(tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(rd.root), str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in (2, 1, 0)]  # joiners first: they wait for rank 0's file
    outs = {}
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err[-3000:]
            words = out.split()
            outs[int(words[1])] = words
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
    expected_bytes = 64 * 64 * 2 + 40 * 40 * 4 + 2 * 16 * 4 + 8 + 33 + 6 * 8 * 4 + 5 * 3 * 2
    for r in range(3):
        _, _, generation, nbytes, mismatch = outs[r]
        assert generation == "1" and int(nbytes) == expected_bytes
        assert mismatch == ("self" if r == 2 else "other")  # every rank raised, the odd one knows it is odd
    info = json.loads(rd.rendezvous_file("weights").read_text())
    assert info["world_size"] == 3 and info["generation"] == 1 and info["backend"] == "gloo"
    assert json.loads(rd.rendezvous_file("trainer").read_text())["world_size"] == 2


def test_restarted_rank0_publishes_a_new_generation(tmp_path):
    rd = RunDir.create(tmp_path / "run")
    with form_group(rd, "g", rank=0, world_size=1, timeout_s=10) as first:
        t = torch.ones(3)
        first.all_reduce(t)
        assert torch.equal(t, torch.ones(3))
        nonce = RendezvousInfo.read(rd.rendezvous_file("g")).nonce
    with form_group(rd, "g", rank=0, world_size=1, timeout_s=10) as second:
        info = RendezvousInfo.read(rd.rendezvous_file("g"))
        assert second.generation == info.generation == 2 and info.nonce != nonce
        sd = {"w": torch.randn(4, 4)}
        assert broadcast_state_dict(second, sd) == 64


def test_nobody_publishes_times_out_clearly(tmp_path):
    rd = RunDir.create(tmp_path / "run")
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"waiting for rank 0 of group 'g' to publish .*rendezvous/g.json "
                                          r"\(last seen: no file yet\)"):
        form_group(rd, "g", rank=1, world_size=2, timeout_s=0.5)
    assert time.monotonic() - t0 < 5


def test_stale_file_is_not_joined(tmp_path):
    rd = RunDir.create(tmp_path / "run")
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rd.rendezvous_file("g").write_text(json.dumps({
        "group": "g", "host": "127.0.0.1", "port": port, "world_size": 2, "generation": 4, "nonce": "dead",
        "backend": "gloo", "time": time.time() - 3600, "pid": 1}))
    with pytest.raises(WaitTimeout, match=r"last seen: generation 4 is stale \(nobody answers at 127.0.0.1:"):
        form_group(rd, "g", rank=1, world_size=2, timeout_s=1.0, probe_timeout_s=0.2)
    with pytest.raises(WaitTimeout, match="generation 4 is older than 5"):
        form_group(rd, "g", rank=1, world_size=2, timeout_s=0.5, min_generation=5)


def test_nobody_joins_times_out(tmp_path):
    rd = RunDir.create(tmp_path / "run")
    with pytest.raises(WaitTimeout, match=r"waiting for all 2 ranks of group 'g' \(generation 1\) to join"):
        form_group(rd, "g", rank=0, world_size=2, timeout_s=1.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_group_on_gpu(tmp_path):
    rd = RunDir.create(tmp_path / "run")
    with form_group(rd, "gpu", rank=0, world_size=1, device="cuda:0", timeout_s=60) as group:
        assert RendezvousInfo.read(rd.rendezvous_file("gpu")).backend == "nccl"
        x = torch.arange(4.0, device="cuda")
        group.all_reduce(x)
        group.broadcast(x)
        assert torch.equal(x.cpu(), torch.arange(4.0))
        sd = {"w": torch.randn(300, 300, device="cuda").bfloat16(), "b": torch.ones(7, device="cuda"),
              "m": torch.ones(5, device="cuda", dtype=torch.bool)}
        before = {k: v.clone() for k, v in sd.items()}
        assert broadcast_state_dict(group, sd, bucket_bytes=1024) == 300 * 300 * 2 + 28 + 5
        assert all(torch.equal(sd[k], before[k]) for k in sd)
