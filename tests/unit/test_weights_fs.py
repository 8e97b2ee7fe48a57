"""Weight snapshots on a full or read-only filesystem: one clear error naming the file, the previous snapshot intact.

Uses a small tmpfs mount when the tests run as root (root ignores permission bits, so a mount is the only honest
way to get ENOSPC/EROFS); the injected-error test runs everywhere.
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch

from relax_hpc.errors import RunDirError
from relax_hpc.fsio import TMP_PREFIX
from relax_hpc.rundir import RunDir
from relax_hpc.weights import SnapshotPublisher, SnapshotReader, latest_version


def _mount(cmd: list[str]) -> bool:
    return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs, unmounted afterwards (skipped where mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0 or not _mount(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)]):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mnt
    finally:
        _mount(["umount", "-l", str(mnt)])


def no_debris(rd: RunDir) -> bool:
    return not any(p.name.startswith(TMP_PREFIX) for p in rd.weights.rglob("*"))


def test_full_disk_fails_cleanly(small_fs: Path):
    rd = RunDir.create(small_fs / "run")
    pub = SnapshotPublisher(rd, max_file_bytes=1 << 20)
    pub.publish({"a": torch.ones(256, 1024)}, 1, 1)  # 1 MiB
    big = {f"w{i}": torch.full((256, 1024), 2.0) for i in range(4)}  # 4 MiB: does not fit
    with pytest.raises(RunDirError, match=r"cannot write .*weights/.*: no space left on device") as info:
        pub.publish(big, 2, 2)
    assert "\n" not in str(info.value)
    assert latest_version(rd) == 1 and not rd.snapshot(2).exists()
    assert no_debris(rd)  # the half-written publish was removed, so the disk has room again
    version, sd, _ = SnapshotReader(rd).load(verify="sha256")
    assert version == 1 and torch.equal(sd["a"], torch.ones(256, 1024))
    pub.publish({"a": torch.full((256, 1024), 3.0)}, 2, 2)
    assert latest_version(rd) == 2


def test_read_only_filesystem(small_fs: Path):
    rd = RunDir.create(small_fs / "run")
    pub = SnapshotPublisher(rd)
    pub.publish({"a": torch.ones(8)}, 1, 1)
    if not _mount(["mount", "-o", "remount,ro", str(small_fs)]):
        pytest.skip("cannot remount read-only")
    try:
        with pytest.raises(RunDirError, match=r"cannot write .*weights/.*: read-only filesystem"):
            pub.publish({"a": torch.zeros(8)}, 2, 2)
        # a reader on a read-only mount cannot take a lease but still loads the complete snapshot
        version, sd, _ = SnapshotReader(rd, name="ro-reader").load()
        assert version == 1 and torch.equal(sd["a"], torch.ones(8))
    finally:
        _mount(["mount", "-o", "remount,rw", str(small_fs)])
    assert latest_version(rd) == 1


def test_injected_write_error_names_the_file(tmp_path, monkeypatch):
    rd = RunDir.create(tmp_path / "run")
    pub = SnapshotPublisher(rd, max_file_bytes=64)
    pub.publish({"a": torch.ones(4)}, 1, 1)
    import relax_hpc.weights.publisher as publisher

    real = publisher.write_file
    calls = []

    def failing(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(publisher, "write_file", failing)
    with pytest.raises(RunDirError, match=r"model-00002-of-00003.safetensors: disk quota exceeded"):
        pub.publish({"a": torch.ones(16), "b": torch.ones(16), "c": torch.ones(16)}, 2, 2)
    assert latest_version(rd) == 1 and no_debris(rd)
    assert torch.equal(SnapshotReader(rd).load().state_dict["a"], torch.ones(4))


def test_a_large_file_read_on_several_threads_is_byte_exact_and_a_short_one_is_refused(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """Unhashed reads of large files split into one range per core (preadv per thread): every byte lands where it
    belongs, and a file that ends before its size (truncated after the stat) is a SnapshotError."""
    import numpy as np

    from relax_hpc.errors import SnapshotError
    from relax_hpc.weights import format as fmt

    monkeypatch.setattr(fmt, "CHUNK_BYTES", 1 << 16)
    monkeypatch.setattr(fmt, "PARALLEL_READ_BYTES", 1 << 18)
    monkeypatch.setattr(fmt, "usable_cores", lambda: 3)
    data = np.random.default_rng(0).integers(0, 256, (1 << 20) + 12345, dtype=np.uint8).tobytes()
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    buf, stream = fmt.read_file(path, len(data), None)
    assert stream == -1 and buf.numpy().tobytes() == data
    real_stat = fmt.os.stat
    monkeypatch.setattr(fmt.os, "stat", lambda p: type("S", (), {"st_size": len(data) + 100})()
                        if Path(p) == path else real_stat(p))
    with pytest.raises(SnapshotError, match="ended after"):
        fmt.read_file(path, len(data) + 100, None)
