"""Weight snapshots across real processes: ranks publishing parts, publishers SIGKILLed mid-write, and a reader
loading while a writer publishes and deletes in a loop."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from relax_hpc.fsio import TMP_PREFIX
from relax_hpc.rundir import RunDir
from relax_hpc.weights import SnapshotPublisher, SnapshotReader, complete_versions, latest_version

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import os, sys, time, traceback
import torch
torch.set_num_threads(1)
from relax_hpc.weights import Shard, SnapshotPublisher, SnapshotReader

role, run = sys.argv[1], sys.argv[2]


def model(v):
    # 8 tensors of 256 KB, filled with the version: any mix of versions or partial file is visible
    return {f"layers.{i}.w": torch.full((256, 256), float(v)) for i in range(8)}


def forked(fn, *args):
    # torch is imported once, here; each role still runs in a process of its own (fork before any torch op)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        os._exit(code)
    return pid


def rank_main(rank, world):
    full = torch.arange(world * 4 * 5, dtype=torch.float32).reshape(world * 4, 5)
    part = {"shared": full[rank * 4:(rank + 1) * 4], f"own.{rank}": torch.full((3,), float(rank)).bfloat16()}
    time.sleep(0.2 * (world - rank))  # the leader does not come last
    pub = SnapshotPublisher(run, part_timeout_s=60)
    pub.publish_part(part, version=1, step=10, rank=rank, world_size=world, token="job7",
                     shards={"shared": Shard(0, rank * 4, tuple(full.shape))})
    print("done", rank, flush=True)


def publish_forever():
    pub = SnapshotPublisher(run, keep_last=2, max_file_bytes=600_000, debris_after_s=3600)
    while True:
        v = pub.next_version()
        pub.publish(model(v), v, v)


def writer_main(seconds):
    pub = SnapshotPublisher(run, keep_last=2, max_file_bytes=600_000)
    end = time.monotonic() + seconds
    v = 0
    while time.monotonic() < end or (v < 12 and time.monotonic() < end + 60):  # 12 versions, however loaded
        v = pub.next_version()
        pub.publish(model(v), v, v)
    pub.wait_housekeeping()
    os.write(1, f"published {v}\n".encode())  # one write: the two forked children share the pipe


def reader_main(seconds):
    reader = SnapshotReader(run, name="rollout-1")
    seen = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end or (len(seen) < 4 and time.monotonic() < end + 60):
        if reader.poll() is None:
            time.sleep(0.001)
            continue
        v, sd, m = reader.load(verify="sha256")
        assert m["version"] == v and len(sd) == 8, (v, sorted(sd))
        for k, t in sd.items():
            assert bool((t == float(v)).all()), f"v{v}: {k} holds another version"
        seen.add(v)
    os.write(1, f"loaded {len(seen)}\n".encode())


if role == "ranks":  # world_size processes, one per rank
    world = int(sys.argv[3])
    pids = [forked(rank_main, r, world) for r in range(world)]
    codes = [os.waitpid(pid, 0)[1] for pid in pids]
    sys.exit(0 if not any(codes) else 1)
elif role == "spawner":  # forks a publisher on demand; the test kills it by its pid
    for line in sys.stdin:
        if line.strip() != "go":
            break
        pid = forked(publish_forever)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print("reaped", status, flush=True)
elif role == "writer_and_reader":
    seconds = float(sys.argv[3])
    pids = [forked(writer_main, seconds), forked(reader_main, seconds)]
    codes = [os.waitpid(pid, 0)[1] for pid in pids]
    sys.exit(0 if not any(codes) else 1)
"""


def child(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CHILD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def finish(procs: list[subprocess.Popen], timeout: float = 60) -> list[str]:
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        finally:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def test_three_ranks_publish_parts(tmp_path):
    rd = RunDir.create(tmp_path / "run")
    (out,) = finish([child("ranks", str(rd.root), "3")])
    assert all(f"done {r}" in out for r in range(3))
    version, sd, m = SnapshotReader(rd).load()
    assert version == 1 and m["world_size"] == 3 and len(m["files"]) == 3
    assert torch.equal(sd["shared"], torch.arange(60, dtype=torch.float32).reshape(12, 5))
    for r in range(3):
        assert sd[f"own.{r}"].dtype == torch.bfloat16 and torch.equal(sd[f"own.{r}"].float(), torch.full((3,), r * 1.0))
    assert not any(p.name.startswith(TMP_PREFIX) for p in rd.weights.iterdir())


def test_publisher_killed_mid_write_never_breaks_latest(tmp_path):
    rd = RunDir.create(tmp_path / "run")
    spawner = child("spawner", str(rd.root))
    rng = random.Random(1234)
    debris: set[str] = set()
    debris_trials = 0
    try:
        for trial in range(20):
            spawner.stdin.write("go\n")
            spawner.stdin.flush()
            pid = int(spawner.stdout.readline())
            # first trial: let the first publish land; later: kill anywhere in a publish
            time.sleep(2.0 if trial == 0 else rng.uniform(0.0, 0.15))
            os.kill(pid, signal.SIGKILL)
            assert spawner.stdout.readline().startswith("reaped")
            now = {p.name for p in rd.weights.iterdir() if p.name.startswith(TMP_PREFIX)}
            debris_trials += bool(now - debris)  # this kill left a half-written publish behind
            debris |= now
            latest = latest_version(rd)
            assert latest is not None, "the first publish did not finish in 2 s"
            version, sd, _ = SnapshotReader(rd, name="checker").load(verify="sha256")
            assert version == latest
            assert all(bool((t == float(version)).all()) for t in sd.values())
        spawner.stdin.write("quit\n")
        spawner.stdin.flush()
        finish([spawner], timeout=10)
    finally:
        if spawner.poll() is None:
            os.kill(spawner.pid, signal.SIGKILL)
            spawner.wait()
    assert debris_trials >= 3, "kills never landed inside a publish: the test did not test anything"
    pub = SnapshotPublisher(rd, keep_last=2)
    assert pub.clean_debris(older_than_s=0)
    assert not any(p.name.startswith(TMP_PREFIX) for p in rd.weights.iterdir())
    assert latest_version(rd) in complete_versions(rd)
    v = pub.next_version()
    pub.publish({"x": torch.ones(1)}, v, v)  # publishing resumes after the debris
    assert latest_version(rd) == v


def test_reader_never_sees_a_partial_snapshot(tmp_path):
    rd = RunDir.create(tmp_path / "run")
    SnapshotPublisher(rd).publish({f"layers.{i}.w": torch.zeros(256, 256) for i in range(8)}, 0, 0)
    (out,) = finish([child("writer_and_reader", str(rd.root), "4")], timeout=150)
    published = int(out.split("published")[1].split()[0])
    loaded = int(out.split("loaded")[1].split()[0])
    assert published >= 10, out
    assert loaded >= 3, out  # it loaded several different versions while they were being published and deleted
    assert len(complete_versions(rd)) <= 3
