"""Weight snapshots in one process: round trips, splitting, parts and shards, verification, retention, leases."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from relax_hpc.errors import RunDirError, SnapshotError, WaitTimeout
from relax_hpc.fsio import TMP_PREFIX
from relax_hpc.rundir import RunDir
from relax_hpc.weights import (
    Shard,
    SnapshotPublisher,
    SnapshotReader,
    complete_versions,
    latest_version,
    live_leases,
    pinned_versions,
)
from relax_hpc.weights.manifest import write_latest
from relax_hpc.weights.retention import take_lease


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layer.0.w": torch.randn(32, 32, generator=g),
        "layer.0.norm": torch.randn(32, generator=g).to(torch.float16),
        "layer.0.bias": torch.randn(5, generator=g).double(),
        "counter": torch.tensor(seed, dtype=torch.int64),
        "mask": torch.rand(7, generator=g) > 0.5,
        "ids": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "fp8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 4),
        "lm_head.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)), k


def test_round_trip_all_dtypes_and_split(rd):
    sd = state(1)
    pub = SnapshotPublisher(rd, max_file_bytes=3000)
    folder = pub.publish(sd, version=1, step=7, model_config={"hidden_size": 32}, extra={"note": "x"})
    assert folder == rd.snapshot(1) and (folder / "COMPLETE").is_file()
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) >= 3  # 4 KB embed and lm_head cannot share a 3000-byte file
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["version"] == 1 and manifest["step"] == 7 and manifest["dtype"] == "BF16"
    assert manifest["model_config"] == {"hidden_size": 32} and manifest["extra"] == {"note": "x"}
    assert {f["name"] for f in manifest["files"]} == {f.name for f in files}
    assert all(len(f["sha256"]) == 64 and f["bytes"] == (folder / f["name"]).stat().st_size for f in manifest["files"])
    # the files are standard safetensors
    from_lib = {}
    for f in files:
        from_lib.update(load_file(f))
    assert_same(from_lib, sd)
    assert latest_version(rd) == 1 and latest_version(rd.root) == 1
    version, loaded, m = SnapshotReader(rd).load()
    assert version == 1 and m["step"] == 7
    assert_same(loaded, sd)


def test_poll_and_load_into_module_in_place(rd):
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)
    target = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    reader = SnapshotReader(rd, name="rollout-3")
    assert reader.poll() is None
    pub = SnapshotPublisher(rd)
    pub.publish(target, 1, 1)
    assert reader.poll() == 1
    weight_before = model[0].weight
    assert reader.load_into(model) == 1
    assert model[0].weight is weight_before  # updated in place, same parameter object
    assert_same(model.state_dict(), target)
    assert reader.poll() is None  # nothing newer than what it loaded
    pub.publish({k: v * 2 for k, v in target.items()}, 2, 2)
    assert reader.poll() == 2
    as_dict = {k: torch.zeros_like(v, dtype=torch.float32) for k, v in target.items()}  # dtype converted by copy_
    assert reader.load_into(as_dict) == 2
    assert torch.equal(as_dict["0.weight"], (target["0.weight"] * 2).float())


def test_load_into_mismatch_leaves_model_unchanged(rd):
    SnapshotPublisher(rd).publish({"0.weight": torch.ones(4, 8), "0.bias": torch.ones(4)}, 1, 1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SnapshotError, match=r"missing \['1.bias', '1.weight'\]"):
        SnapshotReader(rd).load_into(model)
    small = torch.nn.Linear(8, 3)
    with pytest.raises(SnapshotError, match=r"tensor .0\.weight. has shape \[4, 8\], the model has \[3, 8\]"):
        SnapshotReader(rd).load_into({"0.weight": small.weight.data, "0.bias": small.bias.data})
    assert_same(model.state_dict(), before)


def test_parts_and_shards_from_several_ranks(rd):
    full = torch.randn(10, 6).to(torch.bfloat16)
    col = torch.randn(4, 9)
    rows = [(0, 3), (3, 7), (7, 10)]
    pub = SnapshotPublisher(rd, max_file_bytes=100, part_timeout_s=5)
    for rank in (2, 1, 0):  # the leader (rank 0) commits once every part is there
        a, b = rows[rank]
        part = {"w": full[a:b], "c": col[:, rank * 3:(rank + 1) * 3], f"only.{rank}": torch.full((3,), float(rank))}
        shards = {"w": Shard(0, a, (10, 6)), "c": Shard(1, rank * 3, (4, 9))}
        out = pub.publish_part(part, version=5, step=50, rank=rank, world_size=3, shards=shards, token="job1")
        assert out == rd.snapshot(5)
        assert (latest_version(rd) == 5) == (rank == 0)
    version, sd, m = SnapshotReader(rd).load()
    assert version == 5 and m["world_size"] == 3
    assert sorted(sd) == ["c", "only.0", "only.1", "only.2", "w"]
    assert torch.equal(sd["w"], full) and torch.equal(sd["c"], col)
    assert torch.equal(sd["only.2"], torch.full((3,), 2.0))
    assert not any(p.name.startswith(TMP_PREFIX) for p in rd.weights.iterdir())


def test_parts_that_do_not_fit_are_refused_before_publishing(rd):
    pub = SnapshotPublisher(rd, part_timeout_s=5)
    pub.publish_part({"w": torch.ones(2, 2)}, version=1, step=1, rank=1, world_size=2, token="a",
                     shards={"w": Shard(0, 3, (5, 2))})
    with pytest.raises(SnapshotError, match="gap or overlap at 2"):
        pub.publish_part({"w": torch.ones(2, 2)}, version=1, step=1, rank=0, world_size=2, token="a",
                         shards={"w": Shard(0, 0, (5, 2))})
    pub.publish_part({"x": torch.ones(2)}, version=2, step=1, rank=1, world_size=2, token="a")
    with pytest.raises(SnapshotError, match="'x' is published whole by more than one rank"):
        pub.publish_part({"x": torch.ones(2)}, version=2, step=1, rank=0, world_size=2, token="a")
    assert latest_version(rd) is None and complete_versions(rd) == []


def test_leader_times_out_naming_missing_ranks(rd):
    pub = SnapshotPublisher(rd, part_timeout_s=0.3)
    pub.publish_part({"x": torch.ones(2)}, version=1, step=1, rank=2, world_size=4, token="t")
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout, match=r"ranks still missing: \[1, 3\]"):
        pub.publish_part({"y": torch.ones(2)}, version=1, step=1, rank=0, world_size=4, token="t")
    assert time.monotonic() - t0 < 5
    assert latest_version(rd) is None


def test_bit_flip_is_detected_by_sha256_and_truncation_by_size(rd):
    sd = state(2)
    SnapshotPublisher(rd, max_file_bytes=2000).publish(sd, 1, 1)
    victim = sorted(rd.snapshot(1).glob("*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x10
    victim.write_bytes(bytes(data))
    model = {k: torch.zeros_like(v) for k, v in sd.items()}
    with pytest.raises(SnapshotError, match=f"{victim.name}: sha256 .* does not match"):
        SnapshotReader(rd).load_into(model)
    assert all(not v.any() for k, v in model.items() if v.dtype != torch.float8_e4m3fn)  # untouched
    SnapshotReader(rd).load(verify="size")  # a flipped bit with the right size passes a size-only check
    victim.write_bytes(bytes(data[:-1]))
    with pytest.raises(SnapshotError, match=f"{victim.name} has .* bytes, the manifest says"):
        SnapshotReader(rd).load(verify="size")


def test_bad_manifest_and_missing_snapshot_name_the_file(rd):
    reader = SnapshotReader(rd)
    with pytest.raises(SnapshotError, match="no complete weight snapshot"):
        reader.load()
    SnapshotPublisher(rd).publish({"x": torch.ones(3)}, 1, 1)
    manifest = rd.snapshot(1) / "manifest.json"
    m = json.loads(manifest.read_text())
    m["files"][0]["sha256"] = "nope"
    manifest.write_text(json.dumps(m))
    with pytest.raises(SnapshotError, match=r"manifest.json: files\[0\].sha256 must be 64 hex digits"):
        reader.load()
    manifest.write_text("{not json")
    with pytest.raises(SnapshotError, match=r"cannot read .*manifest\.json"):
        reader.load()
    with pytest.raises(SnapshotError, match="v000009"):
        reader.load(9)


def test_bad_inputs(rd, tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(RunDirError, match="not a relax-hpc run dir"):
        SnapshotPublisher(plain)
    with pytest.raises(RunDirError, match="not a relax-hpc run dir"):
        SnapshotReader(plain)
    pub = SnapshotPublisher(rd)
    with pytest.raises(SnapshotError, match="'x' is a list"):
        pub.publish({"x": [1, 2]}, 1, 1)
    with pytest.raises(SnapshotError, match="empty state dict"):
        pub.publish({}, 1, 1)
    pub.publish({"x": torch.ones(1)}, 3, 1)
    with pytest.raises(SnapshotError, match=r"version 2 is not newer than LATEST \(3\).*publish 4"):
        pub.publish({"x": torch.ones(1)}, 2, 1)
    with pytest.raises(ValueError, match="reader name"):
        SnapshotReader(rd, name="../evil")


def test_retention_keeps_last_k_pinned_and_leased(rd):
    pub = SnapshotPublisher(rd, keep_last=2)
    for v in range(1, 4):
        pub.publish({"x": torch.full((4,), float(v))}, v, v)
    pub.wait_housekeeping()  # retention runs beside the caller after each publish
    assert complete_versions(rd) == [2, 3]
    pub.pin(2, "eval baseline")
    take_lease(rd, "rollout-7", 3, lease_s=60)
    take_lease(rd, "rollout-8", 1, lease_s=-1)  # expired: ignored
    assert live_leases(rd) == {3: ["rollout-7"]}
    for v in range(4, 7):
        pub.publish({"x": torch.full((4,), float(v))}, v, v)
    pub.wait_housekeeping()
    assert complete_versions(rd) == [2, 3, 5, 6]  # 2 pinned, 3 leased, 5-6 the last two
    pub.unpin(2)
    (rd.weight_lease("rollout-7")).unlink()
    assert pub.apply_retention() == [2, 3]
    assert complete_versions(rd) == [5, 6] and pinned_versions(rd) == set()
    _, sd, _ = SnapshotReader(rd).load()
    assert torch.equal(sd["x"], torch.full((4,), 6.0))


def test_reader_falls_back_when_latest_is_gone_and_debris_is_cleaned(rd):
    pub = SnapshotPublisher(rd, keep_last=5)
    pub.publish({"x": torch.ones(2)}, 1, 1)
    pub.publish({"x": torch.ones(2) * 2}, 2, 2)
    (rd.weights / f"{TMP_PREFIX}v000003.host.1.2").mkdir()
    (rd.weights / f"{TMP_PREFIX}LATEST.host.1.2").write_text("{")
    (rd.weight_leases / f"{TMP_PREFIX}rollout-0.json.host.1.2").write_text("{")
    import shutil

    shutil.rmtree(rd.snapshot(2))  # deleted by hand behind LATEST's back
    version, sd, _ = SnapshotReader(rd).load()
    assert version == 1 and torch.equal(sd["x"], torch.ones(2))
    assert pub.clean_debris(older_than_s=3600) == []
    assert len(pub.clean_debris(older_than_s=0)) == 3
    assert not any(p.name.startswith(TMP_PREFIX) for p in rd.weights.rglob("*"))
    assert pub.next_version() == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_load_to_gpu_and_into_a_gpu_module(rd):
    sd = state(3)
    SnapshotPublisher(rd, max_file_bytes=2000).publish(sd, 1, 1)
    _, on_gpu, _ = SnapshotReader(rd).load(device="cuda")
    assert all(t.device.type == "cuda" for t in on_gpu.values())
    assert_same({k: v.cpu() for k, v in on_gpu.items()}, sd)
    model = torch.nn.Linear(32, 64).cuda().bfloat16()
    SnapshotPublisher(rd).publish({"weight": sd["embed.weight"], "bias": sd["embed.weight"][:, 0].clone()}, 2, 2)
    weight = model.weight
    assert SnapshotReader(rd).load_into(model) == 2
    assert model.weight is weight and torch.equal(model.weight.cpu(), sd["embed.weight"])


def test_retention_gives_back_a_snapshot_leased_during_deletion(rd, monkeypatch):
    pub = SnapshotPublisher(rd, keep_last=1)
    for v in (1, 2):
        pub.publish({"x": torch.full((2,), float(v))}, v, v)
    pub.wait_housekeeping()
    pub.publish({"x": torch.full((2,), 3.0)}, 3, 3)
    pub.wait_housekeeping()
    SnapshotPublisher(rd, keep_last=5).publish({"x": torch.full((2,), 4.0)}, 4, 4)
    from relax_hpc.weights import retention

    real = retention.live_leases
    looks = []

    def lease_appears(rd_):  # nobody at the first look; a reader leases v3 right after the folder was renamed
        looks.append(1)
        if len(looks) == 1:
            return {}
        take_lease(rd_, "late-reader", 3, lease_s=60)
        return real(rd_)

    monkeypatch.setattr(retention, "live_leases", lease_appears)
    assert retention.apply_retention(rd, keep_last=1) == []
    assert complete_versions(rd) == [3, 4]
    assert torch.equal(SnapshotReader(rd).load(3).state_dict["x"], torch.full((2,), 3.0))


def test_parallel_hash_streams_match_hashlib(rd, monkeypatch):
    import hashlib
    import os

    from relax_hpc.weights.format import HashPipeline

    blobs = [os.urandom(n) for n in (0, 1, 5000, 300_000, 70_000)]
    with HashPipeline(threads=3) as hasher:
        streams = [hasher.stream() for _ in blobs]
        for off in range(0, 300_000, 4096):  # interleaved chunks, as several files being read
            for s, blob in zip(streams, blobs, strict=True):
                if off < len(blob):
                    hasher.feed(s, memoryview(blob)[off:off + 4096])
        digests = hasher.finish()
    assert digests == [hashlib.sha256(b).hexdigest() for b in blobs]
    with HashPipeline(threads=0) as inline:  # no workers: hashed as fed, on this thread
        assert not inline._threads
        streams = [inline.stream() for _ in blobs]
        for s, blob in zip(streams, blobs, strict=True):
            inline.feed(s, blob)
        assert inline.finish() == digests
    pub = SnapshotPublisher(rd, max_file_bytes=1000)
    pub.publish(state(4), 1, 1)
    import relax_hpc.weights.format as fmt

    monkeypatch.setattr(fmt, "hash_threads", lambda: 3)
    # publishing and loading with several workers agree with the manifest written before
    _, sd, m = SnapshotReader(rd).load(verify="sha256")
    pub.publish(sd, 2, 2)
    m2 = json.loads((rd.snapshot(2) / "manifest.json").read_text())
    assert [f["sha256"] for f in m2["files"]] == [f["sha256"] for f in m["files"]]


def test_small_and_large_snapshots_write_the_same_files(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to ``INLINE_BYTES`` a snapshot is hashed and fsynced on the publishing thread, above it on worker threads:
    the same bytes, sha256s and verification either way."""
    import threading

    import relax_hpc.weights.publisher as publisher

    sd = {f"layer{i}.weight": torch.randn(64, 64) for i in range(6)}
    started: list[str] = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda t: (started.append(t.name), real_start(t))[1])
    manifests = []
    for limit, name in ((1 << 30, "inline"), (0, "threads")):
        monkeypatch.setattr(publisher, "INLINE_BYTES", limit)
        rd = RunDir.create(tmp_path / name)
        started.clear()
        SnapshotPublisher(rd, max_file_bytes=40_000).publish(sd, 1, 1)
        workers = [n for n in started if n.startswith(("sha256", "fsync"))]
        assert (workers == []) == (name == "inline"), started
        _, loaded, m = SnapshotReader(rd).load(verify="sha256")
        assert all(torch.equal(loaded[k], v) for k, v in sd.items())
        manifests.append([(f["name"], f["bytes"], f["sha256"]) for f in m["files"]])
    assert manifests[0] == manifests[1] and len(manifests[0]) > 1


def test_is_new_sees_folders_beyond_a_lagging_latest_and_then_trusts_its_own_commits(rd, monkeypatch) -> None:
    """A resumed leader publishes only versions newer than LATEST and every complete folder on disk; once it has
    committed a version itself, later versions are new without reading the disk (one leader per run)."""
    import relax_hpc.weights.publisher as publisher

    old = SnapshotPublisher(rd)
    for v in (1, 2, 3):
        old.publish(state(v), v, v)
    write_latest(rd, 2, 2, time.time())  # killed between the folder's rename and LATEST's update
    pub = SnapshotPublisher(rd)  # the next incarnation
    assert not pub.is_new(2) and not pub.is_new(3) and pub.is_new(4)
    pub.publish(state(4), 4, 4)
    assert not pub.is_new(4)
    monkeypatch.setattr(publisher, "complete_versions", lambda _rd: pytest.fail("read the disk"))
    assert pub.is_new(5)


def test_a_version_trained_again_after_a_kill_moves_a_lagging_latest_to_its_folder(rd) -> None:
    """Killed between the rename of v3 and the LATEST write (LATEST still v2), resumed from step 2: step 3 is trained
    again, v3 is not new (its folder is there), and LATEST must still move to it, or readers that follow LATEST stay
    on v2 for good (a chaos run did: its workers made v2 samples for 11 minutes, every one dropped as stale)."""
    old = SnapshotPublisher(rd)
    for v in (1, 2, 3):
        old.publish(state(v), v, v)
    write_latest(rd, 2, 2, time.time())
    pub = SnapshotPublisher(rd)
    assert not pub.is_new(3)
    assert pub.adopt(3)
    assert latest_version(rd) == 3
    assert not pub.adopt(3) and not pub.adopt(2)  # LATEST is not older: nothing to do, never moved back
    assert not pub.adopt(7)  # no such folder
    assert pub.is_new(4)


def test_adopting_an_older_version_never_hides_newer_folders(rd) -> None:
    """LATEST lost and resumed from step 4 with v5 and v6 on disk: step 4 is adopted, and v5 and v6 stay not new
    (adopted in turn when trained again, never written over: that raised "v000005 already exists")."""
    old = SnapshotPublisher(rd)
    for v in (4, 5, 6):
        old.publish(state(v), v, v)
    (rd.weights / "LATEST").unlink()
    pub = SnapshotPublisher(rd)
    assert not pub.is_new(4) and pub.adopt(4)
    assert not pub.is_new(5) and pub.adopt(5) and latest_version(rd) == 5
    assert not pub.is_new(6) and pub.adopt(6) and latest_version(rd) == 6
    assert pub.is_new(7)


def test_poll_rereads_latest_when_its_stat_looks_unchanged(rd):
    """A network client's attribute cache can show LATEST's old stat for its whole timeout; poll still reads the
    file (opened by name: close-to-open) every REREAD_S, so a new version is seen within REREAD_S. Emulated on the
    local disk by rewriting LATEST in place with content of the same size and its old mtime restored."""
    import os
    import time

    from relax_hpc.weights.reader import REREAD_S

    pub = SnapshotPublisher(rd, keep_last=5)
    for v in (3, 4):
        pub.publish({"w": torch.full((4,), float(v))}, v, v)
    latest = rd.weights_latest
    text = latest.read_text()
    latest.write_text(text.replace('"version": 4', '"version": 3').replace("v000004", "v000003"))
    reader = SnapshotReader(rd)
    assert reader.poll() == 3
    reader.load(3)
    st = os.stat(latest)
    assert len(text) == st.st_size
    with open(latest, "r+") as f:  # same inode, same size, same mtime: a stat cannot tell
        f.write(text)
    os.utime(latest, ns=(st.st_atime_ns, st.st_mtime_ns))
    deadline = time.monotonic() + REREAD_S + 2
    while reader.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reader.poll() == 4
