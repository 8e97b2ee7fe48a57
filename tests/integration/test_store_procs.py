"""The store under real processes and real signals: concurrent writers and ranks, writers and readers SIGKILLed."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from relax_hpc.fsio import atomic_write_json, read_json, remove_debris, wait_for
from relax_hpc.rundir import RunDir
from relax_hpc.store import ConsumerGroup, Sample, SampleGroup, ShardWriter, read_shard

pytestmark = pytest.mark.integration
CTX = multiprocessing.get_context("fork")


def make_group(gid: str, n: int = 4, version: int = 0, tensor_bytes: int = 0) -> SampleGroup:
    rng = np.random.default_rng(abs(hash(gid)) % 2**32)
    samples = []
    for i in range(n):
        length = int(rng.integers(1, 50))
        tensors = {"pv": rng.standard_normal(tensor_bytes // 4).astype(np.float32)} if tensor_bytes else {}
        samples.append(
            Sample(
                prompt_ids=rng.integers(0, 1000, 8, dtype=np.int32),
                response_ids=rng.integers(0, 1000, length, dtype=np.int32),
                logprobs=-rng.random(length, dtype=np.float32),
                reward=float(i),
                version=version,
                metadata={"uid": f"{gid}/{i}"},
                tensors=tensors,
            )
        )
    return SampleGroup(gid, samples)


def uids(samples: list[Sample]) -> list[str]:
    return [s.metadata["uid"] for s in samples]


def _exit_on_error(fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn`` in a forked child; any exception becomes exit code 1 (after printing it)."""
    try:
        fn(*args)
    except BaseException as exc:  # pragma: no cover - reported through the exit code
        print(f"child failed: {type(exc).__name__}: {exc}", flush=True)
        os._exit(1)
    os._exit(0)


def _start(fn: Callable[..., None], *args: Any) -> multiprocessing.Process:
    p = CTX.Process(target=_exit_on_error, args=(fn, *args))
    p.start()
    return p


# ------------------------------------------------------------------------------ 8 writers + 2 ranks, concurrently
def _writer(root: str, idx: int, num_shards: int) -> None:
    rng = random.Random(idx)
    with ShardWriter(root, f"rollout-{idx}.{idx:04x}", background=idx % 2 == 1) as w:
        for k in range(num_shards):
            w.write([make_group(f"w{idx}-{k}-{g}", version=k) for g in range(2)])
            time.sleep(rng.uniform(0, 0.01))


def _rank(root: str, rank: int, total: int, out: str, acks: str) -> None:
    c = ConsumerGroup(root, rank=rank, world_size=2)
    got: list[str] = []
    consumed = step = 0
    while consumed < total:
        step += 1
        plan = c.plan(step, min(32, total - consumed), timeout_s=30) if rank == 0 else c.wait_plan(step, 30)
        got += uids(c.read(plan))
        consumed += plan.num_samples
        ack = Path(acks) / f"{step}"
        if rank == 1:
            ack.touch()
        elif step % 3 == 0:  # a "checkpoint": both ranks are done with the step, then commit (retention deletes)
            wait_for(ack.exists, what=f"rank 1 ack of step {step}", timeout_s=30)
            c.commit(c.position_after(step))
    atomic_write_json(out, {"uids": got, "steps": step, "counters": dict(c.counters)})


def test_many_writers_two_ranks_exactly_once(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    (tmp_path / "acks").mkdir()
    num_writers, num_shards = 8, 12
    total = num_writers * num_shards * 2 * 4
    readers = [
        _start(_rank, str(rd.root), r, total, str(tmp_path / f"rank{r}.json"), str(tmp_path / "acks")) for r in (0, 1)
    ]
    writers = [_start(_writer, str(rd.root), i, num_shards) for i in range(num_writers)]
    for p in writers + readers:
        p.join(60)
        assert p.exitcode == 0, f"child {p.pid} exit code {p.exitcode}"
    got = {r: read_json(tmp_path / f"rank{r}.json") for r in (0, 1)}
    everything = got[0]["uids"] + got[1]["uids"]
    expected = {
        f"w{i}-{k}-{g}/{s}" for i in range(num_writers) for k in range(num_shards) for g in range(2) for s in range(4)
    }
    assert len(everything) == len(set(everything)) == total  # none duplicated
    assert set(everything) == expected  # none lost
    assert len(got[0]["uids"]) == len(got[1]["uids"]) == total // 2
    assert got[0]["counters"].get("quarantined_shards", 0) == 0
    left = [p for p in rd.shards.rglob("*.h5")]
    assert len(left) < num_writers * num_shards  # retention deleted what the commits covered


# ------------------------------------------------------------------------------------- writers SIGKILLed mid-write
def _endless_writer(root: str, writer_id: str, background: bool) -> None:
    w = ShardWriter(root, writer_id, background=background)
    k = 0
    while True:
        w.write([make_group(f"{writer_id}-{k}-{g}", n=2, tensor_bytes=100_000) for g in range(2)])
        k += 1


def test_writer_killed_at_random_points(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    rng = random.Random(7)
    trials = 24
    for trial in range(trials):
        writer_id = f"victim-{trial}.{trial:04x}"
        p = _start(_endless_writer, str(rd.root), writer_id, trial % 2 == 1)
        folder = rd.writer_shards(writer_id)
        target = rng.randrange(5)  # kill after a few publishes, at a random point of the next write
        wait_for(lambda: folder.exists() and len(os.listdir(folder)) >= target, what="publishes", timeout_s=30)  # noqa: B023
        time.sleep(rng.uniform(0, 0.04))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
    published = 0
    for trial in range(trials):
        writer_id = f"victim-{trial}.{trial:04x}"
        names = sorted(os.listdir(rd.writer_shards(writer_id))) if rd.writer_shards(writer_id).exists() else []
        assert [int(n[:12]) for n in names] == list(range(len(names)))  # no gap, no partial file visible
        for n in names:
            samples = read_shard(rd.shard_file(writer_id, n))  # every visible shard is complete and verifies
            seq = int(n[:12])
            assert uids(samples) == [f"{writer_id}-{seq}-{g}/{i}" for g in range(2) for i in range(2)]
            published += len(samples)
    assert published > 0
    debris = os.listdir(rd.samples_tmp)
    assert all(name.startswith(".tmp-") for name in debris)
    remove_debris(rd.samples_tmp, older_than_s=0)
    assert os.listdir(rd.samples_tmp) == []
    c = ConsumerGroup(rd)
    plan = c.plan_available(1, 10**6)
    assert plan.num_samples == published and len(c.read(plan)) == published
    assert c.counters["quarantined_shards"] == 0 and not os.listdir(rd.quarantine)


# ------------------------------------------------------------------------------------ a reader killed and resumed
def _trainer(root: str, ckpt: str, total: int) -> None:
    """A toy trainer: consumes 8 samples per step, checkpoints (position + what it trained on) every 2 steps."""
    state = read_json(ckpt, default=None)
    c = ConsumerGroup(root)
    step, trained = 0, []
    if state is not None:
        c.resume(state["position"])
        step, trained = state["step"], state["trained"]
    while len(trained) < total:
        step += 1
        plan = c.plan(step, 8, timeout_s=30)
        trained += uids(c.read(plan))
        time.sleep(0.02)  # "training": slow enough that the first incarnations are killed before they finish
        if step % 2 == 0 or len(trained) >= total:
            position = c.position_after(step)
            atomic_write_json(ckpt, {"step": step, "position": position, "trained": trained})
            c.commit(position)


def test_reader_killed_and_resumed(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    ckpt = str(tmp_path / "trainer-ckpt.json")
    w = ShardWriter(rd, "early.0")
    for k in range(20):
        w.write([make_group(f"e{k}-{g}") for g in range(2)])
    late = _start(_writer, str(rd.root), 3, 20)  # keeps publishing while the trainer dies and comes back
    total = 20 * 8 + 20 * 8
    rng = random.Random(3)
    kills = 0
    for _ in range(6):
        p = _start(_trainer, str(rd.root), ckpt, total)
        time.sleep(rng.uniform(0.05, 0.25))
        if p.exitcode is None:
            os.kill(p.pid, signal.SIGKILL)
            kills += 1
        p.join(10)
    final = _start(_trainer, str(rd.root), ckpt, total)
    final.join(60)
    late.join(60)
    assert final.exitcode == 0 and late.exitcode == 0 and kills >= 3
    trained = read_json(ckpt)["trained"]
    expected = {f"e{k}-{g}/{i}" for k in range(20) for g in range(2) for i in range(4)}
    expected |= {f"w3-{k}-{g}/{i}" for k in range(20) for g in range(2) for i in range(4)}
    assert len(trained) == len(set(trained)) == total  # nothing repeated
    assert set(trained) == expected  # nothing skipped
    position = json.loads(rd.consumer_position().read_text())
    assert position["writers"] == {"early.0": [20, 0, 0], "rollout-3.0003": [20, 0, 0]}
