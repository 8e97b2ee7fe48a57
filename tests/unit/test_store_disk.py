"""Full disks, read-only run dirs and folders that are not run dirs: one clear error, published shards intact."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.errors import RunDirError
from relax_hpc.rundir import RunDir
from relax_hpc.store import ConsumerGroup, Sample, SampleGroup, ShardWriter, read_shard
from relax_hpc.store.shard import EncodedShard


def make_group(gid: str, tensor_bytes: int = 0) -> SampleGroup:
    tensors = {"pv": np.ones(tensor_bytes // 4, np.float32)} if tensor_bytes else {}
    s = Sample(
        prompt_ids=np.arange(4, dtype=np.int32),
        response_ids=np.arange(6, dtype=np.int32),
        logprobs=np.zeros(6, np.float32),
        reward=1.0,
        metadata={"uid": gid},
        tensors=tensors,
    )
    return SampleGroup(gid, [s])


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs (needs root and mount rights; skipped otherwise)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)):
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)  # busy: detach it anyway


def test_full_disk_names_the_file_and_keeps_published_shards(small_fs: Path) -> None:
    rd = RunDir.create(small_fs / "run")
    writer = ShardWriter(rd, "w.0")
    first = writer.write([make_group("a")])
    with pytest.raises(RunDirError, match=r"cannot write shard .*000000000001.* no space left on device") as err:
        writer.write([make_group("big", tensor_bytes=2 << 20)])
    assert str(rd.writer_shards("w.0")) in str(err.value)
    assert os.listdir(rd.samples_tmp) == []  # the partial temporary file was removed
    assert [s.metadata["uid"] for s in read_shard(first.path)] == ["a"]
    assert writer.write([make_group("b")]).seq == 1  # space again: the same seq is retried
    c = ConsumerGroup(rd)
    assert [s.metadata["uid"] for s in c.read(c.plan(1, 2, timeout_s=1))] == ["a", "b"]


def test_read_only_run_dir(small_fs: Path) -> None:
    rd = RunDir.create(small_fs / "run")
    first = ShardWriter(rd, "w.0").write([make_group("a")])
    if not _mount("-o", "remount,ro", str(small_fs)):
        pytest.skip("cannot remount read-only here")
    with pytest.raises(RunDirError, match=r"cannot write shard .*: read-only filesystem"):
        ShardWriter(rd, "w.0").write([make_group("b")])
    with pytest.raises(RunDirError, match=r"cannot create shard folder .*w.1: read-only filesystem"):
        ShardWriter(rd, "w.1")
    with pytest.raises(RunDirError, match="read-only filesystem"):
        ConsumerGroup(rd, "fresh")  # the leader must be able to write its plans
    assert [s.metadata["uid"] for s in read_shard(first.path)] == ["a"]


@pytest.mark.parametrize(("code", "reason"), [(errno.ENOSPC, "no space left on device"), (errno.EROFS, "read-only")])
@pytest.mark.parametrize("background", [False, True])
def test_injected_write_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, reason: str, background: bool
) -> None:
    """The same guarantees where no filesystem can be mounted: the failure is injected into the shard write."""
    rd = RunDir.create(tmp_path / "run")
    writer = ShardWriter(rd, "w.0", background=background)
    first = writer.write([make_group("a")])
    real_write = EncodedShard.write

    def failing(self: EncodedShard, path: Path, *, fsync: bool = True) -> None:
        path.write_bytes(b"partial")
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(EncodedShard, "write", failing)
    with pytest.raises(RunDirError, match=rf"cannot write shard .*000000000001.*{reason}"):
        writer.write([make_group("b")])
    monkeypatch.setattr(EncodedShard, "write", real_write)
    assert writer.write([make_group("c")]).seq == 1
    writer.close()
    assert os.listdir(rd.samples_tmp) == []
    assert [s.metadata["uid"] for s in read_shard(first.path)] == ["a"]


def test_background_publish_failure_leaves_no_gap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rd = RunDir.create(tmp_path / "run")
    writer = ShardWriter(rd, "w.0", background=True)
    writer.write([make_group("a")])
    writer.flush()
    real_rename = os.rename
    calls = {"n": 0}

    def rename_once_failing(src: str | Path, dst: str | Path) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EIO, "Input/output error")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_once_failing)
    writer.write([make_group("b")])  # its publish fails on the publisher thread
    with pytest.raises(RunDirError, match=r"cannot write shard .*000000000001.*Input/output error"):
        writer.flush()
    writer.write([make_group("b2")])  # retried as seq 1
    writer.close()
    names = sorted(os.listdir(rd.writer_shards("w.0")))
    assert [n[:12] for n in names] == ["000000000000", "000000000001"]
    assert [s.metadata["uid"] for s in read_shard(rd.shard_file("w.0", names[1]))] == ["b2"]
    assert os.listdir(rd.samples_tmp) == []


def test_folders_that_are_not_run_dirs(tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hello")
    for bad in (tmp_path / "plain", tmp_path / "missing"):
        with pytest.raises(RunDirError, match=r"is not a relax-hpc run dir|does not exist"):
            ShardWriter(bad)
        with pytest.raises(RunDirError, match=r"is not a relax-hpc run dir|does not exist"):
            ConsumerGroup(bad)
    assert sorted(os.listdir(tmp_path / "plain")) == ["notes.txt"]  # nothing written there
