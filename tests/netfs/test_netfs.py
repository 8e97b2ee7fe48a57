"""The run dir on a real network filesystem: sshfs over loopback (tools/netfs.sh), one export mounted twice as two
"client nodes" would mount one NFS export, each mount with its own attribute and directory caches.

* the store and snapshot protocol suites run with their run dirs on mount A;
* a writer publishing through mount A and a consumer planning through mount B: every sample exactly once, and
  each new shard seen within the mounts' cache timeout;
* a snapshot published through A is found and verified through B;
* the fully_async demo with its run dir on the mount.

Needs root (FUSE mounts, sshd); skipped with the reason otherwise, unless RELAX_REQUIRE_NETFS=1 (CI), where a
missing mount fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from relax_hpc.rundir import RunDir
from relax_hpc.store import ConsumerGroup, Sample, SampleGroup, ShardWriter
from relax_hpc.weights import SnapshotPublisher, SnapshotReader
from tests.helpers.runutil import DEMO, REPO, cli

pytestmark = pytest.mark.netfs
NETFS_DIR = Path(os.environ.get("NETFS_DIR", "/tmp/relax-netfs"))
CACHE_TIMEOUT_S = 20.0
"""tools/netfs.sh's sshfs cache_timeout: the longest a mount may show a stale attribute or listing."""


def _up() -> bool:
    res = subprocess.run(["bash", str(REPO / "tools" / "netfs.sh"), "status"], capture_output=True, timeout=60)
    return res.returncode == 0


@pytest.fixture(scope="module")
def mounts() -> tuple[Path, Path]:
    problem = None
    if not _up():
        if os.geteuid() != 0:
            problem = "the sshfs mounts of tools/netfs.sh need root (FUSE, sshd); not root here"
        else:
            res = subprocess.run(["bash", str(REPO / "tools" / "netfs.sh"), "start"], capture_output=True,
                                 text=True, timeout=600)
            if res.returncode or not _up():
                problem = f"tools/netfs.sh start failed: {res.stderr.strip()[-500:]}"
    if problem:
        if os.environ.get("RELAX_REQUIRE_NETFS") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    return NETFS_DIR / "a", NETFS_DIR / "b"


@pytest.fixture
def shared(mounts: tuple[Path, Path]) -> tuple[Path, Path]:
    """A fresh folder on the export, as seen through mount A and through mount B."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    a, b = mounts[0] / name, mounts[1] / name
    a.mkdir()
    return a, b


def _group(gid: str, n: int = 4) -> SampleGroup:
    return SampleGroup(gid, [Sample(prompt_ids=np.arange(3, dtype=np.int32), response_ids=np.full(5, i, np.int32),
                                    logprobs=np.zeros(5, np.float32), reward=float(i), metadata={"uid": f"{gid}/{i}"})
                             for i in range(n)])


@pytest.mark.slow
def test_protocol_suites_on_the_mount(mounts: tuple[Path, Path]) -> None:
    base = mounts[0] / f"pytest-{uuid.uuid4().hex[:8]}"
    suites = ["tests/unit/test_store_consumer.py", "tests/unit/test_store_disk.py", "tests/unit/test_store_format.py",
              "tests/unit/test_store_watch.py", "tests/unit/test_weights.py", "tests/unit/test_weights_fs.py",
              "tests/unit/test_rundir_events.py", "tests/integration/test_store_procs.py",
              "tests/integration/test_weights_procs.py", "tests/unit/test_store_announce.py"]
    # The stat-only watch test asserts that a stat shows a new entry at once, which an attribute cache hides by
    # design; the protocol relies on the watch's age fallback there (the cross-mount test below exercises it).
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={base}",
                          "--deselect",
                          "tests/unit/test_store_watch.py::test_samples_watch_sees_new_writers_and_shards",
                          "--deselect",
                          "tests/unit/test_store_announce.py::test_samples_watch_stats_the_announce_folder",
                          *suites], capture_output=True, text=True, timeout=1500, cwd=REPO)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout.splitlines()[-1]


def test_writer_on_one_mount_consumer_on_the_other(shared: tuple[Path, Path]) -> None:
    a, b = shared
    rd_a = RunDir.create(a / "run")
    rd_b = RunDir(b / "run")
    groups_per_shard, steps = 2, 6
    published: dict[int, float] = {}

    def write() -> None:
        w = ShardWriter(rd_a, "rollout-0.x")
        for k in range(steps):
            w.write([_group(f"g{k}.{j}") for j in range(groups_per_shard)])
            published[k] = time.monotonic()
            time.sleep(0.5)

    t = threading.Thread(target=write)
    t.start()
    consumer = ConsumerGroup(rd_b)
    seen: list[str] = []
    lags = []
    try:
        for step in range(1, steps + 1):
            plan = consumer.plan(step, 4 * groups_per_shard, timeout_s=CACHE_TIMEOUT_S * 3)
            lags.append(time.monotonic() - published.get(step - 1, time.monotonic()))
            seen += [s.metadata["uid"] for s in consumer.read(plan)]
            consumer.commit(consumer.position_after(step))
    finally:
        t.join(timeout=120)
    assert len(seen) == len(set(seen)) == steps * groups_per_shard * 4
    assert max(lags) < CACHE_TIMEOUT_S + 5, lags


def test_snapshot_published_on_one_mount_is_found_on_the_other(shared: tuple[Path, Path]) -> None:
    a, b = shared
    rd_a = RunDir.create(a / "run")
    pub = SnapshotPublisher(rd_a, keep_last=2)
    reader = SnapshotReader(RunDir(b / "run"))
    for version in range(3):
        sd = {"w": torch.full((64, 64), float(version)), "b": torch.arange(10.0) + version}
        pub.publish(sd, version=version, step=version)
        t0 = time.monotonic()
        while reader.poll() is None and time.monotonic() - t0 < CACHE_TIMEOUT_S + 10:
            time.sleep(0.2)
        snap = reader.load()
        assert snap.version == version and float(snap.state_dict["w"][0, 0]) == version


@pytest.mark.slow
@pytest.mark.integration
def test_fully_async_demo_on_the_mount(shared: tuple[Path, Path]) -> None:
    a, _ = shared
    rd = a / "run"
    res = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(rd), "--set", "mode=fully_async",
              "--set", "num_steps=12", "--set", "warmup.steps=0", "--set", "rollout.prompts_per_step=4",
              "--set", "rollout.n_samples=4", "--set", "trainer.checkpoint_every=4", timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert json.loads((rd / "STATUS.json").read_text())["state"] == "completed"
    assert not list((rd / "samples" / "quarantine").iterdir())
