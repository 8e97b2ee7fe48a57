"""Delta snapshots: bit-exact round trips with both codecs, a full version every K and above the size fraction,
corrupted deltas and bases and a missing base detected with a fall back to an older intact version, retention that
keeps every base a kept or leased delta needs, and the HF folder a delta version materialises into."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from relax_hpc.errors import SnapshotError
from relax_hpc.rundir import RunDir
from relax_hpc.weights import DeltaPolicy, SnapshotPublisher, SnapshotReader, apply_retention, load_snapshot
from relax_hpc.weights.delta import DELTA_FILE
from relax_hpc.weights.manifest import read_manifest
from relax_hpc.weights.retention import take_lease


def versions(n: int, *, frac: float = 0.03, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` consecutive states: bf16 and fp32 tensors, each step changing about ``frac`` of the elements."""
    g = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(64, 96, generator=g).bfloat16(), "b": torch.randn(96, generator=g),
             "e": torch.randn(33, 7, generator=g).half()}
    out = []
    for _ in range(n):
        out.append({k: v.clone() for k, v in state.items()})
        for k, v in state.items():
            mask = torch.rand(v.shape, generator=g) < frac
            state[k] = torch.where(mask, v + (torch.randn(v.shape, generator=g) * 0.05).to(v.dtype), v)
    return out


def kinds(rd: RunDir, vs: list[int]) -> list[int | None]:
    return [(read_manifest(rd.snapshot(v)).get("delta") or {}).get("base") for v in vs]


@pytest.mark.parametrize("codec", ["xor-zstd", "sparse"])
def test_delta_round_trip_is_bit_exact_and_small(tmp_path: Path, codec: str) -> None:
    rd = RunDir.create(tmp_path / "run")
    pub = SnapshotPublisher(rd, keep_last=10, delta=DeltaPolicy(every_full=3, max_fraction=0.5, codec=codec))
    states = versions(7)
    for i, sd in enumerate(states, 1):
        pub.publish(sd, version=i, step=i)
        pub.wait_housekeeping()
    assert kinds(rd, list(range(1, 8))) == [None, 1, 1, None, 4, 4, None]  # a full version every 3
    for i, sd in enumerate(states, 1):
        got, manifest = load_snapshot(rd.snapshot(i))
        assert set(got) == set(sd)
        for k in sd:
            assert got[k].dtype == sd[k].dtype and torch.equal(got[k].view(torch.uint8), sd[k].view(torch.uint8))
        if manifest.get("delta"):
            assert manifest["total_bytes"] < 0.3 * manifest["delta"]["full_bytes"]
    assert SnapshotReader(rd).load().version == 7


def test_delta_larger_than_fraction_is_written_full(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    pub = SnapshotPublisher(rd, delta=DeltaPolicy(every_full=10, max_fraction=0.2))
    a = {"w": torch.randn(128, 64)}
    pub.publish(a, version=1, step=1)
    pub.publish({"w": a["w"].clone().index_fill_(0, torch.tensor([3]), 1.0)}, version=2, step=2)  # one row changed
    pub.publish({"w": torch.randn(128, 64)}, version=3, step=3)  # everything changed
    pub.wait_housekeeping()
    assert kinds(rd, [1, 2, 3]) == [None, 1, None]


def _published(tmp_path: Path, n: int = 4) -> tuple[RunDir, list[dict[str, torch.Tensor]]]:
    rd = RunDir.create(tmp_path / "run")
    pub = SnapshotPublisher(rd, keep_last=10, delta=DeltaPolicy(every_full=10))
    states = versions(n)
    for i, sd in enumerate(states, 1):
        pub.publish(sd, version=i, step=i)
    pub.wait_housekeeping()
    assert kinds(rd, list(range(1, n + 1))) == [None] + [1] * (n - 1)
    return rd, states


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def test_corrupted_delta_is_detected_and_reader_falls_back(tmp_path: Path) -> None:
    rd, states = _published(tmp_path)
    _flip(rd.snapshot(4) / DELTA_FILE, 40)
    with pytest.raises(SnapshotError, match="corrupt delta"):
        load_snapshot(rd.snapshot(4))
    snap = SnapshotReader(rd).load()
    assert snap.version == 3 and torch.equal(snap.state_dict["w"].view(torch.uint8), states[2]["w"].view(torch.uint8))


def test_corrupted_delta_payload_fails_the_per_tensor_checksum(tmp_path: Path) -> None:
    """A payload damaged along with the file sha256 in the manifest (or read with verify: size) is still caught."""
    rd, _ = _published(tmp_path)
    folder = rd.snapshot(3)
    m = json.loads((folder / "manifest.json").read_text())
    piece = m["tensors"]["b"]["pieces"][0]
    assert piece["codec"] == "xor-zstd"
    _flip(folder / DELTA_FILE, piece["offset"] + piece["bytes"] - 1)
    with pytest.raises(SnapshotError, match="tensor 'b'"):
        load_snapshot(folder, verify="size")


def test_pieces_are_checked_by_xxh3_and_those_without_it_by_sha256(tmp_path: Path) -> None:
    """A delta piece records the xxh3_128 of its reconstructed bytes, which the reader checks; a piece that has only
    the sha256 (a delta written before the xxh3 field) is checked by that, and a wrong sha256 is still caught."""
    import xxhash

    rd, states = _published(tmp_path)
    folder = rd.snapshot(3)
    m = json.loads((folder / "manifest.json").read_text())
    pieces = {name: t["pieces"][0] for name, t in m["tensors"].items()}
    for name, piece in pieces.items():
        assert piece["xxh3_128"] == xxhash.xxh3_128_hexdigest(states[2][name].contiguous().view(torch.uint8).numpy())
        assert "sha256" not in piece  # one checksum per tensor on publish
    for name, piece in pieces.items():  # a delta of before: sha256 instead
        del piece["xxh3_128"]
        piece["sha256"] = hashlib.sha256(states[2][name].contiguous().view(torch.uint8).numpy().data).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(m))
    got, _ = load_snapshot(folder, verify="size")
    assert all(torch.equal(got[k].view(torch.uint8), states[2][k].view(torch.uint8)) for k in states[2])
    pieces["w"]["sha256"] = "0" * 64
    (folder / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SnapshotError, match=r"tensor 'w'.*checksum"):
        load_snapshot(folder, verify="size")


def test_corrupted_base_falls_back_to_newest_intact_full_version(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    pub = SnapshotPublisher(rd, keep_last=10, delta=DeltaPolicy(every_full=3))
    states = versions(5)
    for i, sd in enumerate(states, 1):
        pub.publish(sd, version=i, step=i)
    pub.wait_housekeeping()
    assert kinds(rd, [1, 2, 3, 4, 5]) == [None, 1, 1, None, 4]
    _flip(rd.snapshot(4) / "model.safetensors", 200)  # the base of v5
    with pytest.raises(SnapshotError, match="base snapshot is damaged"):
        load_snapshot(rd.snapshot(5))
    snap = SnapshotReader(rd).load()  # v5 (delta of damaged v4), v4 fail; v3 = v1 + delta is intact
    assert snap.version == 3 and torch.equal(snap.state_dict["e"], states[2]["e"])


def test_missing_base_is_an_error_not_a_vanished_file(tmp_path: Path) -> None:
    import shutil

    rd, _ = _published(tmp_path, 3)
    shutil.rmtree(rd.snapshot(1))
    with pytest.raises(SnapshotError, match=r"base snapshot .* is missing"):
        load_snapshot(rd.snapshot(3))
    with pytest.raises(SnapshotError, match="missing"):
        SnapshotReader(rd).load()  # nothing intact is left: one clear error, no retry loop


def test_retention_keeps_the_base_of_kept_and_leased_deltas(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    pub = SnapshotPublisher(rd, keep_last=2, delta=DeltaPolicy(every_full=4))
    for i, sd in enumerate(versions(7), 1):
        pub.publish(sd, version=i, step=i)
        pub.wait_housekeeping()
    # v1 full, v2-4 deltas of v1, v5 full, v6-7 deltas of v5: keep v6, v7 and their base v5
    assert sorted(int(p.name[1:]) for p in rd.weights.glob("v0*")) == [5, 6, 7]
    for v in (5, 6, 7):
        load_snapshot(rd.snapshot(v))
    rd2 = RunDir.create(tmp_path / "run2")
    pub2 = SnapshotPublisher(rd2, keep_last=1, delta=DeltaPolicy(every_full=4))
    for i, sd in enumerate(versions(6), 1):
        if i == 3:
            take_lease(rd2, "rollout-0", 2, 600)  # a reader is loading delta v2 (base v1)
        pub2.publish(sd, version=i, step=i)
        pub2.wait_housekeeping()
    assert apply_retention(rd2, 1) == []
    assert sorted(int(p.name[1:]) for p in rd2.weights.glob("v0*")) == [1, 2, 5, 6]
    load_snapshot(rd2.snapshot(2))


def test_delta_version_materialises_into_an_hf_folder(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from relax_hpc.weights.materialise import materialise
    from tests.helpers.tinymodel import IDS
    from tests.helpers.tinymodel import tiny_demo_model as tiny

    model = tiny()
    rd = RunDir.create(tmp_path / "run")
    pub = SnapshotPublisher(rd, delta=DeltaPolicy(every_full=10, max_fraction=1.0))
    conf = model.config.to_dict()
    pub.publish(model.state_dict(), version=1, step=1, model_config=conf)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[:3] += 0.01
    folder = pub.publish(model.state_dict(), version=2, step=2, model_config=conf)
    assert read_manifest(folder)["delta"]["base"] == 1 and not (folder / "config.json").exists()
    out = materialise(folder, tmp_path / "hf-v2")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, model(input_ids=IDS).logits)
    assert load_snapshot(out)[1]["version"] == 2
    # a server engine's update-from-disk gets the same: the delta materialised once into a folder of its own
    from relax_hpc.weights.materialise import full_folder

    served_dir = full_folder(folder, tmp_path / "views-full")
    assert served_dir == tmp_path / "views-full" / folder.name and (served_dir / "model.safetensors").is_file()
    assert full_folder(folder, tmp_path / "views-full") == served_dir  # made once
    served = AutoModelForCausalLM.from_pretrained(served_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(served(input_ids=IDS).logits, model(input_ids=IDS).logits)
    assert full_folder(rd.snapshot(1), tmp_path / "views-full") == rd.snapshot(1)  # a full version: itself


def test_delta_config_is_off_by_default_and_validated() -> None:
    from pydantic import ValidationError

    from relax_hpc.config.weights import WeightSyncConfig
    from relax_hpc.weights import delta_policy

    assert WeightSyncConfig().delta is None and delta_policy(None) is None
    cfg = WeightSyncConfig.model_validate({"delta": {"every_full": 5, "max_fraction": 0.1}})
    assert delta_policy(cfg.delta) == DeltaPolicy(every_full=5, max_fraction=0.1, codec="xor-zstd")
    with pytest.raises(ValidationError):
        WeightSyncConfig.model_validate({"delta": {"every_full": 0}})


def test_threaded_reconstruction_is_bit_exact_and_detects_damage(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Large models decode their tensors on several threads (here forced for a small one)."""
    from relax_hpc.weights import delta

    monkeypatch.setattr(delta, "PARALLEL_BYTES", 0)
    monkeypatch.setattr(delta, "decode_threads", lambda: 3)
    rd, states = _published(tmp_path)
    for i, sd in enumerate(states, 1):
        got, _ = load_snapshot(rd.snapshot(i))
        assert all(torch.equal(got[k].view(torch.uint8), sd[k].view(torch.uint8)) for k in sd)
    piece = read_manifest(rd.snapshot(4))["tensors"]["w"]["pieces"][0]
    _flip(rd.snapshot(4) / DELTA_FILE, piece["offset"] + piece["bytes"] // 2)
    with pytest.raises(SnapshotError, match="tensor 'w'"):
        load_snapshot(rd.snapshot(4), verify="size")


def test_reconstruction_reuses_the_base_buffers_but_copies_one_shared_by_two_names(tmp_path: Path) -> None:
    """The base state is the reconstruction's own: each tensor is rebuilt in its base tensor's buffer (no second
    model-sized allocation), except a buffer two names share (tied weights), which would be XORed twice."""
    from relax_hpc.weights.delta import apply_delta

    rd, states = _published(tmp_path)
    folder = rd.snapshot(3)
    manifest = read_manifest(folder)
    assert manifest["delta"]["base"] == 1
    base, _ = load_snapshot(rd.snapshot(1))
    tied = {**base, "b": base["w"]}  # "b" made an alias of "w": a tensor whose base buffer is not its own
    tied_manifest = json.loads(json.dumps(manifest))
    tied_manifest["tensors"]["b"] = dict(manifest["tensors"]["w"])
    ptr_w, ptr_e = base["w"].data_ptr(), base["e"].data_ptr()
    got = apply_delta(folder, tied_manifest, tied, verify="sha256")
    assert got["e"].data_ptr() == ptr_e  # rebuilt in place
    assert ptr_w not in (got["w"].data_ptr(), got["b"].data_ptr())  # the shared buffer was copied for each name
    for k, want in (("w", "w"), ("b", "w"), ("e", "e")):
        assert torch.equal(got[k].view(torch.uint8), states[2][want].view(torch.uint8)), k


def test_missing_base_falls_back_to_the_newest_intact_version(tmp_path: Path) -> None:
    """The base of the newest deltas is gone (deleted by hand, or not yet visible on a late joiner's mount): the
    reader loads the newest version that still reconstructs (an older full version's delta), not an error."""
    import shutil

    rd = RunDir.create(tmp_path / "run")
    pub = SnapshotPublisher(rd, keep_last=10, delta=DeltaPolicy(every_full=3))
    states = versions(6)
    for i, sd in enumerate(states, 1):
        pub.publish(sd, version=i, step=i)
    pub.wait_housekeeping()
    assert kinds(rd, [1, 2, 3, 4, 5, 6]) == [None, 1, 1, None, 4, 4]
    shutil.rmtree(rd.snapshot(4))
    with pytest.raises(SnapshotError, match=r"base snapshot .* is missing"):
        load_snapshot(rd.snapshot(6))
    snap = SnapshotReader(rd).load()  # v6 and v5 need the missing v4; v3 = v1 + its delta
    assert snap.version == 3
    assert all(torch.equal(snap.state_dict[k].view(torch.uint8), states[2][k].view(torch.uint8)) for k in states[2])


@pytest.mark.parametrize("scratch", [None, 256], ids=["fresh-buffer", "scratch-buffer"])
@pytest.mark.parametrize("length", [99, 101])
def test_an_xor_payload_of_the_wrong_length_is_refused(scratch: int | None, length: int) -> None:
    """A frame that decompresses to fewer or more bytes than the tensor has is an error on both decompression
    paths (into a fresh buffer, and into a reused scratch buffer larger than the tensor)."""
    import numpy as np
    import zstandard

    from relax_hpc.weights.delta import decode_tensor

    base = np.arange(100, dtype=np.uint8)
    buf = None if scratch is None else np.empty(scratch, np.uint8)
    bad = zstandard.ZstdCompressor().compress(np.ones(length, np.uint8).tobytes())
    with pytest.raises(SnapshotError, match="decompressed"):
        decode_tensor("xor-zstd", bad, base.copy(), 100, 1, in_place=True, scratch=buf)
    good = zstandard.ZstdCompressor().compress(np.ones(100, np.uint8).tobytes())
    assert np.array_equal(decode_tensor("xor-zstd", good, base.copy(), 100, 1, in_place=True, scratch=buf), base ^ 1)
