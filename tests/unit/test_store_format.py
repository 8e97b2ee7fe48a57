"""The shard format: round trips of every field, validation before anything is written, corruption detection."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import h5py
import numpy as np
import pytest

from relax_hpc.errors import CorruptShardError, SampleValidationError
from relax_hpc.rundir import RunDir
from relax_hpc.store import Sample, SampleGroup, ShardWriter, h5raw, read_shard, to_torch
from relax_hpc.store import shard as shard_mod
from relax_hpc.store.shard import blocksum, encode_shard
from relax_hpc.store.shard_reader import load_small, read_groups


def text_sample(rng: np.random.Generator, uid: str, version: int = 0, **extra) -> Sample:
    n = int(rng.integers(0, 40))
    return Sample(
        prompt_ids=rng.integers(0, 50_000, int(rng.integers(1, 30)), dtype=np.int64),
        response_ids=rng.integers(0, 50_000, n, dtype=np.int32),
        logprobs=-rng.random(n),
        reward=float(rng.standard_normal()),
        version=version,
        metadata={"uid": uid},
        **extra,
    )


def test_round_trip_every_field(rd: RunDir) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    bf16 = torch.randn(3, 5).to(torch.bfloat16)
    samples = []
    for i in range(6):
        n = [0, 1, 7, 33, 2, 12][i]  # ragged, including an empty response
        tensors = {}
        if i % 2 == 0:
            tensors["pixel_values"] = rng.standard_normal((4 + i, 6)).astype(np.float32)
            tensors["image_grid_thw"] = np.array([[1, 2, 2 + i]], np.int64)
        if i == 1:
            tensors["input_features"] = torch.randn(2, 3, 4)  # a torch tensor, float32
            tensors["frames"] = bf16  # bf16 from torch
            tensors["flags"] = np.array([True, False, True])
        if i == 3:
            tensors["frames"] = torch.randn(2, 2).to(torch.bfloat16)
            tensors["scalar"] = np.float16(1.5) * np.ones((), np.float16)  # 0-d
        samples.append(
            Sample(
                prompt_ids=rng.integers(0, 150_000, 5 + i).astype(np.int32),
                response_ids=rng.integers(0, 150_000, n),
                logprobs=-rng.random(n).astype(np.float32),
                reward=float(i) - 0.5,
                loss_mask=(rng.random(n) > 0.3) if i % 2 else None,
                version=7 + i,
                version_first=6 + i if i == 2 else None,
                version_last=9 + i if i == 2 else None,
                rewards={"format": 0.5, "length": -float(i)},
                timings={"generate": 1.25, "reward": 0.01 * i},
                metadata={"uid": f"s{i}", "turns": [1, 2], "nested": {"a": None}},
                tensors=tensors,
            )
        )
    info = ShardWriter(rd, "rollout-0.aaaa").write([SampleGroup("g0", samples[:4]), SampleGroup("g1", samples[4:])])
    assert info.path.name == "000000000000.s6.g2.v7-12.h5"
    assert (info.num_samples, info.num_groups, info.min_version, info.max_version) == (6, 2, 7, 12)
    out = read_shard(info.path)
    assert len(out) == 6
    for i, (a, b) in enumerate(zip(samples, out, strict=True)):
        assert b.group_id == ("g0" if i < 4 else "g1")
        assert b.prompt_ids.dtype == np.int32 and np.array_equal(a.prompt_ids, b.prompt_ids)
        assert b.response_ids.dtype == np.int32 and np.array_equal(a.response_ids, b.response_ids)
        assert b.logprobs.dtype == np.float32 and np.array_equal(a.logprobs, b.logprobs)
        mask = np.ones(len(a.response_ids), np.uint8) if a.loss_mask is None else a.loss_mask.astype(np.uint8)
        assert b.loss_mask.dtype == np.uint8 and np.array_equal(mask, b.loss_mask)
        assert b.reward == a.reward and b.rewards == a.rewards and b.timings == a.timings
        assert b.metadata == a.metadata
        assert b.version == a.version
        assert b.version_first == (a.version_first if a.version_first is not None else a.version)
        assert b.version_last == (a.version_last if a.version_last is not None else a.version)
        assert set(b.tensors) == set(a.tensors) == set(b.tensor_dtypes)
        assert b.stale is False
        for name, value in a.tensors.items():
            got = b.tensors[name]
            if isinstance(value, torch.Tensor):
                assert b.tensor_dtypes[name] == str(value.dtype).removeprefix("torch.")
                back = b.torch_tensor(name)
                assert back.dtype == value.dtype and torch.equal(back, value)
            else:
                assert got.dtype == value.dtype and got.shape == value.shape and np.array_equal(got, value)
                assert b.tensor_dtypes[name] == value.dtype.name
    frames = out[1].tensors["frames"]
    assert frames.dtype == np.uint16 and out[1].tensor_dtypes["frames"] == "bfloat16"  # raw bits + dtype name
    assert torch.equal(to_torch(frames, "bfloat16"), bf16)


def test_bfloat16_from_raw_bits_and_ml_dtypes(rd: RunDir) -> None:
    bits = np.arange(12, dtype=np.uint16).reshape(3, 4)
    s = text_sample(np.random.default_rng(1), "x", tensors={"pv": bits}, tensor_dtypes={"pv": "bfloat16"})
    out = read_shard(ShardWriter(rd).write(SampleGroup("g", [s])).path)[0]
    assert out.tensor_dtypes["pv"] == "bfloat16" and np.array_equal(out.tensors["pv"], bits)
    bad = text_sample(np.random.default_rng(1), "y", tensors={"pv": bits.astype(np.int32)})
    bad.tensor_dtypes = {"pv": "bfloat16"}
    with pytest.raises(SampleValidationError, match="tensor 'pv' is int32 but tensor_dtypes says bfloat16"):
        ShardWriter(rd).write(SampleGroup("g", [bad]))


def test_reading_does_not_import_torch(rd: RunDir) -> None:
    rng = np.random.default_rng(2)
    s = text_sample(rng, "a", tensors={"pv": np.ones((2, 2), np.float32)})
    path = ShardWriter(rd).write(SampleGroup("g", [s])).path
    code = (
        "import sys; from relax_hpc.store import read_shard, ConsumerGroup, backlog; "
        f"s = read_shard({str(path)!r}); c = ConsumerGroup({str(rd.root)!r}); p = c.plan(1, 1); "
        "assert len(c.read(p)) == 1 and len(s) == 1; backlog(c.run_dir); "
        "assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt_ids": np.array([1.0, 2.0])}, "group 'g' sample 1: field 'prompt_ids' must hold integer token ids"),
        ({"response_ids": np.zeros((2, 2), np.int32)}, "field 'response_ids' must be 1-D"),
        ({"logprobs": np.zeros(3, np.float32)}, "field 'logprobs' has shape \\(3,\\), expected"),
        ({"logprobs": None}, "required field 'logprobs' is missing"),
        ({"logprobs": np.zeros(4, np.int64)}, "field 'logprobs' must be floating point"),
        ({"loss_mask": np.ones(5, np.uint8)}, "field 'loss_mask' has shape \\(5,\\)"),
        ({"loss_mask": np.full(4, 2, np.uint8)}, "field 'loss_mask' must hold only 0 and 1"),
        ({"loss_mask": np.ones(4, np.float32)}, "field 'loss_mask' must be bool or integer"),
        ({"reward": "high"}, "field 'reward' must be a number"),
        ({"version": -1}, "field 'version' must be an integer >= 0"),
        ({"version_first": 9}, "version_first \\(9\\) > version_last"),
        ({"timings": {"gen": "slow"}}, "field 'timings\\['gen'\\]' must be a number"),
        ({"metadata": {"x": object()}}, "field 'metadata' is not JSON-serialisable"),
        ({"prompt_ids": np.array([2**40], np.int64)}, "token ids outside the int32 range"),
        ({"tensors": {"bad/name": np.zeros(2)}}, "tensor name 'bad/name'"),
        ({"tensors": {"pv": np.array(["a"])}}, "tensor 'pv' has unsupported dtype"),
        ({"tensors": {"pv": [1, 2]}}, "tensor 'pv' must be a numpy array or a torch tensor"),
        ({"tensors": {"pv": np.zeros(2, np.float64)}}, "tensor 'pv' is float64 but earlier samples"),
    ],
)
def test_validation_rejects_bad_samples_before_writing(rd: RunDir, change: dict, message: str) -> None:
    good = Sample(
        prompt_ids=np.arange(3),
        response_ids=np.arange(4),
        logprobs=np.zeros(4),
        reward=1.0,
        tensors={"pv": np.zeros(2, np.float32)},
    )
    bad = Sample(prompt_ids=np.arange(3), response_ids=np.arange(4), logprobs=np.zeros(4), reward=1.0, version=3)
    for key, value in change.items():
        setattr(bad, key, value)
    writer = ShardWriter(rd, "w.1")
    with pytest.raises(SampleValidationError, match=message):
        writer.write(SampleGroup("g", [good, bad]))
    assert list(rd.writer_shards("w.1").iterdir()) == [] and list(rd.samples_tmp.iterdir()) == []
    assert writer.write(SampleGroup("g", [good])).seq == 0  # nothing consumed the sequence number


def test_missing_keys_and_bad_groups(rd: RunDir) -> None:
    with pytest.raises(SampleValidationError, match="missing required key\\(s\\): logprobs, reward"):
        Sample.from_dict({"prompt_ids": [1], "response_ids": [2]})
    with pytest.raises(SampleValidationError, match="unknown key\\(s\\): respones"):
        Sample.from_dict({"prompt_ids": [1], "response_ids": [2], "logprobs": [0.0], "reward": 1, "respones": 1})
    s = Sample.from_dict({"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-0.5], "reward": 1})
    writer = ShardWriter(rd)
    with pytest.raises(SampleValidationError, match="missing required key"):
        writer.write(SampleGroup("g", [s, {"prompt_ids": [1]}]))
    with pytest.raises(SampleValidationError, match="group_id must be a non-empty string"):
        writer.write(SampleGroup("", [s]))
    with pytest.raises(SampleValidationError, match="a group needs at least one sample"):
        writer.write(SampleGroup("g", []))
    with pytest.raises(SampleValidationError, match="at least one group"):
        writer.write([])
    assert read_shard(writer.write(SampleGroup("g", [s])).path)[0].prompt_ids.tolist() == [1, 2]


def _dataset_offset(path: Path, name: str) -> int:
    with h5py.File(path, "r") as f:
        return int(f[name].id.get_offset())


def test_bit_flips_and_truncation_are_detected(rd: RunDir) -> None:
    rng = np.random.default_rng(3)
    groups = [SampleGroup(f"g{g}", [text_sample(rng, f"{g}-{i}") for i in range(3)]) for g in range(4)]
    big = rng.standard_normal((600, 600)).astype(np.float32)  # > 1 MiB: the blocksum digest path
    groups[3].samples[0].tensors = {"pv": big}
    writer = ShardWriter(rd)
    clean = writer.write(groups).path
    data = clean.read_bytes()
    for dataset in ("response_ids", "logprobs", "sample_json", "tensors/pv", "index"):
        path = rd.shard_file(writer.writer_id, f"flip-{dataset.replace('/', '_')}.h5")
        flipped = bytearray(data)
        flipped[_dataset_offset(clean, dataset) + 5] ^= 0x10
        path.write_bytes(bytes(flipped))
        with pytest.raises(CorruptShardError, match="checksum mismatch"):
            read_shard(path)
    truncated = rd.shard_file(writer.writer_id, "truncated.h5")
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptShardError, match="cannot open as HDF5"):
        read_shard(truncated)
    assert len(read_shard(clean)) == 12


def _clean_shard(rd: RunDir, rng: np.random.Generator) -> tuple[Path, list[Sample]]:
    """A small text shard (3 groups of 2 samples) and what reading it gives."""
    groups = [SampleGroup(f"g{g}", [text_sample(rng, f"{g}-{i}") for i in range(2)]) for g in range(3)]
    clean = ShardWriter(rd).write(groups).path
    return clean, read_shard(clean)


def _bit_flipped_copies(rng: np.random.Generator, clean: Path, n: int, prefix: str) -> Iterator[Path]:
    """``n`` copies of ``clean`` beside it, each with one random bit flipped."""
    data = clean.read_bytes()
    for trial in range(n):
        damaged = bytearray(data)
        damaged[int(rng.integers(0, len(data)))] ^= 1 << int(rng.integers(0, 8))
        path = clean.with_name(f"{prefix}{trial}.h5")
        path.write_bytes(bytes(damaged))
        yield path


def test_random_damage_never_returns_wrong_data(rd: RunDir) -> None:
    rng = np.random.default_rng(4)
    clean, expected = _clean_shard(rd, rng)
    detected = 0
    for path in _bit_flipped_copies(rng, clean, 60, "d"):
        try:
            got = read_shard(path)
        except CorruptShardError:
            detected += 1
            continue
        for a, b in zip(expected, got, strict=True):  # undetected flips must have hit unused bytes
            assert np.array_equal(a.response_ids, b.response_ids) and a.metadata == b.metadata
            assert np.array_equal(a.logprobs, b.logprobs) and a.reward == b.reward
    assert detected > 0


def test_blocksum_chains_over_block_multiples() -> None:
    rng = np.random.default_rng(5)
    buf = rng.integers(0, 255, 3 * 4096 + 123, dtype=np.uint8)
    whole = blocksum(buf)
    assert blocksum(buf[4096:], blocksum(buf[:4096])) == whole
    assert blocksum(buf[8192:], blocksum(buf[:8192])) == whole
    flipped = buf.copy()
    flipped[5000] ^= 4
    assert blocksum(flipped) != whole
    swapped = buf.copy()
    swapped[:4096], swapped[4096:8192] = buf[4096:8192], buf[:4096]
    assert blocksum(swapped) != whole


def test_encode_is_columnar() -> None:
    rng = np.random.default_rng(6)
    groups = [SampleGroup(f"g{g}", [text_sample(rng, f"{g}-{i}") for i in range(8)]) for g in range(16)]
    enc = encode_shard(groups, writer_id="w", seq=0)
    assert set(enc.columns) == {"prompt_ids", "response_ids", "loss_mask", "logprobs", "reward", "sample_json"}
    assert enc.columns["response_ids"].shape == (sum(len(s.response_ids) for g in groups for s in g.samples),)


def _same_samples(a: list[Sample], b: list[Sample]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for name in ("prompt_ids", "response_ids", "logprobs", "loss_mask"):
            u, v = getattr(x, name), getattr(y, name)
            assert u.dtype == v.dtype and np.array_equal(u, v), name
        for name in ("reward", "version", "version_first", "version_last", "rewards", "timings", "metadata"):
            assert getattr(x, name) == getattr(y, name), name
        assert (x.group_id, x.tensors, x.tensor_dtypes, x.stale) == (y.group_id, y.tensors, y.tensor_dtypes, y.stale)


def _read_in_memory(path: Path) -> list[Sample]:
    loaded = load_small(path, 1 << 30)
    assert loaded is not None
    res = read_groups(None, loaded.header, path, 0, loaded.header.num_groups, columns=loaded.columns)
    assert not res.bad_groups
    return res.samples


def test_text_shards_are_plain_hdf5_read_with_or_without_the_library(rd: RunDir) -> None:
    rng = np.random.default_rng(7)
    writer = ShardWriter(rd)
    for trial in range(6):
        groups = []
        for g in range(int(rng.integers(1, 5))):
            samples = [text_sample(rng, f"{trial}-{g}-{i}", version=g) for i in range(int(rng.integers(1, 4)))]
            for s in samples:
                if trial == 0:  # every response empty: empty datasets
                    s.response_ids, s.logprobs = np.zeros(0, np.int32), np.zeros(0, np.float32)
                s.rewards = {"format": 0.5} if trial % 2 else {}
                s.loss_mask = (rng.random(len(s.response_ids)) > 0.5) if trial % 3 == 1 else None
            groups.append(SampleGroup(f"g{g}", samples))
        path = writer.write(groups).path
        with h5py.File(path, "r") as f:  # the HDF5 library reads what h5raw laid out
            assert f.attrs["format"] == b"relax-hpc-shard/1"
            assert set(f) == {"header", "index", "prompt_ids", "response_ids", "loss_mask", "logprobs", "reward",
                              "sample_json"}
            assert f["response_ids"].shape == (sum(len(s.response_ids) for g in groups for s in g.samples),)
        _same_samples(read_shard(path), _read_in_memory(path))
        assert [s.metadata["uid"] for s in read_shard(path)] == [s.metadata["uid"] for g in groups for s in g.samples]


def test_in_memory_read_leaves_other_files_to_the_library(rd: RunDir) -> None:
    rng = np.random.default_rng(8)
    multimodal = text_sample(rng, "mm", tensors={"pv": np.ones((2, 3), np.float32)})
    path = ShardWriter(rd).write(SampleGroup("g", [multimodal])).path  # written by the HDF5 library
    assert load_small(path, 1 << 30) is None and len(read_shard(path)) == 1
    text = ShardWriter(rd).write(SampleGroup("g", [text_sample(rng, "t")])).path
    assert load_small(text, 100) is None  # bigger than asked for
    data = text.read_bytes()
    text.write_bytes(data[:-1])  # truncated
    assert load_small(text, 1 << 30) is None
    with pytest.raises(CorruptShardError):
        read_shard(text)


def test_random_damage_never_returns_wrong_data_in_memory(rd: RunDir) -> None:
    rng = np.random.default_rng(9)
    clean, expected = _clean_shard(rd, rng)
    found = 0
    for path in _bit_flipped_copies(rng, clean, 200, "m"):
        loaded = load_small(path, 1 << 30)
        if loaded is None:  # left to the library
            found += 1
            continue
        res = read_groups(None, loaded.header, path, 0, loaded.header.num_groups, columns=loaded.columns)
        found += bool(res.bad_groups)
        good = [s for s in expected if s.group_id not in {f"g{g}" for g in res.bad_groups}]
        _same_samples(good, res.samples)  # undetected flips hit unused bytes
    assert found > 0


def test_shard_at_a_time_validation_agrees_with_sample_by_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """The validation of a whole shard at once takes the common case only; everything else is checked sample by
    sample. Both give the same shard, or the same error."""
    rng = np.random.default_rng(10)
    changes: list[tuple[str, Callable[[Sample], object]]] = [
        ("prompt_ids", lambda s: np.array([1.0, 2.0])),
        ("prompt_ids", lambda s: [1, 2]),
        ("prompt_ids", lambda s: np.array([2**40])),
        ("response_ids", lambda s: np.zeros((1, 1), np.int32)),
        ("logprobs", lambda s: np.zeros(99, np.float32)),
        ("logprobs", lambda s: None),
        ("logprobs", lambda s: list(s.logprobs)),
        ("loss_mask", lambda s: np.ones(99, np.uint8)),
        ("loss_mask", lambda s: np.full(len(s.response_ids), 2, np.uint8)),
        ("loss_mask", lambda s: np.ones(len(s.response_ids), bool)),
        ("reward", lambda s: 3),
        ("reward", lambda s: np.float32(1.5)),
        ("reward", lambda s: True),
        ("version", lambda s: np.int64(2)),
        ("version", lambda s: -1),
        ("version_first", lambda s: 99),
        ("version_last", lambda s: 0),
        ("timings", lambda s: {"t": 1}),
        ("timings", lambda s: {"t": "x"}),
        ("rewards", lambda s: {1: 1.0}),
        ("metadata", lambda s: [1]),
        ("metadata", lambda s: {"x": object()}),
        ("tensors", lambda s: {"pv": np.zeros(2)}),
    ]

    def outcome() -> str:
        try:
            enc = encode_shard(groups, writer_id="w", seq=0)
        except SampleValidationError as exc:
            return f"error: {exc}"
        enc.header.pop("created")
        cols = {k: (str(v.dtype), v.tobytes()) for k, v in enc.columns.items()}  # type: ignore[union-attr]
        return repr((enc.header, enc.index.tobytes(), cols))

    for _ in range(60):
        groups = [SampleGroup(f"g{g}", [text_sample(rng, f"{g}-{i}") for i in range(3)]) for g in range(3)]
        for _ in range(int(rng.integers(0, 3))):
            name, change = changes[int(rng.integers(0, len(changes)))]
            sample = groups[int(rng.integers(0, 3))].samples[int(rng.integers(0, 3))]
            setattr(sample, name, change(sample))
        together = outcome()
        with monkeypatch.context() as m:
            m.setattr(shard_mod, "check_columns", lambda samples: None)
            assert outcome() == together


def test_h5raw_images_open_in_the_hdf5_library(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    dtypes = ["<i1", "<i2", "<i4", "<i8", "<u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8"]
    sizes = [0, *rng.integers(1, 20, 7)]  # an empty dataset too
    datasets = {f"d{k}": (rng.standard_normal(n) * 100).astype(dt) for k, (dt, n) in enumerate(zip(dtypes, sizes))}
    image = h5raw.build_image(datasets, {"format": b"x-1", "n": -(2**40)})
    path = tmp_path / "a.h5"
    path.write_bytes(image)
    with h5py.File(path, "r") as f:
        assert dict(f.attrs) == {"format": b"x-1", "n": -(2**40)}
        for name, arr in datasets.items():
            assert f[name].dtype == arr.dtype and np.array_equal(f[name][()], arr)
    found, attrs = h5raw.locate(image)  # type: ignore[misc]
    assert attrs == {"n": -(2**40)}
    for name, (at, length, dtype) in found.items():
        got = np.frombuffer(image, dtype, length, at) if length else np.empty(0, dtype)
        assert dtype == datasets[name].dtype and np.array_equal(got, datasets[name])
    floats = {dt: np.linspace(-2, 2, 5).astype(dt) for dt in dtypes[8:]}
    path.write_bytes(h5raw.build_image({"f2": floats["<f2"], "f4": floats["<f4"], "f8": floats["<f8"]}, {}))
    with h5py.File(path, "r") as f:
        assert all(np.array_equal(f[k][()], floats[f"<{k}"]) for k in ("f2", "f4", "f8"))
    assert h5raw.locate(path.read_bytes()) is not None and h5raw.locate(b"\x89HDF\r\n\x1a\n" + bytes(200)) is None


@pytest.mark.parametrize("n", [9, 16, 17, 40, h5raw.MAX_DATASETS])
def test_h5raw_lays_out_any_number_of_datasets(tmp_path: Path, n: int) -> None:
    """More names than one symbol table node holds (8): several nodes under the root's B-tree node."""
    rng = np.random.default_rng(n)
    dtypes = ["<i1", "<i4", "<i8", "<u1", "<u2", "<f2", "<f4", "<f8"]
    datasets = {f"c{k:03d}_{'x' * (k % 7)}": (rng.standard_normal(int(rng.integers(0, 30))) * 50).astype(
        dtypes[k % len(dtypes)]) for k in rng.permutation(n)}
    image = h5raw.build_image(datasets, {"format": b"x-1", "k": n})
    path = tmp_path / "many.h5"
    path.write_bytes(image)
    with h5py.File(path, "r") as f:
        assert sorted(f) == sorted(datasets) and f.attrs["k"] == n
        for name, arr in datasets.items():
            assert f[name].dtype == arr.dtype and f[name][()].tobytes() == arr.tobytes()
    found, attrs = h5raw.locate(image)  # type: ignore[misc]
    assert attrs == {"k": n} and sorted(found) == sorted(datasets)
    for name, (at, length, dtype) in found.items():
        got = np.frombuffer(image, dtype, length, at) if length else np.empty(0, dtype)
        assert dtype == datasets[name].dtype and got.tobytes() == datasets[name].tobytes()
    with pytest.raises(ValueError, match="cannot lay out"):
        h5raw.build_image({f"d{k}": np.zeros(1) for k in range(h5raw.MAX_DATASETS + 1)}, {})


def test_text_shard_with_more_columns_is_written_by_the_fast_path(rd: RunDir, tmp_path: Path) -> None:
    """A text shard with 10 more root columns (18 datasets) is still laid out in memory, bit-identical for the HDF5
    library; the shard reader reads its samples the same; past h5raw.MAX_DATASETS the library writes it."""
    from relax_hpc.store.shard import encode_shard

    rng = np.random.default_rng(3)
    groups = [SampleGroup(f"g{g}", [text_sample(rng, f"{g}-{i}") for i in range(3)]) for g in range(4)]
    plain = tmp_path / "plain.h5"
    encode_shard(groups, writer_id="w", seq=0).write(plain)
    for extra, fast in ((10, True), (h5raw.MAX_DATASETS, False)):
        shard = encode_shard(groups, writer_id="w", seq=0)
        cols = {f"extra_{k:03d}": rng.integers(0, 1 << 30, int(rng.integers(0, 40))).astype(np.int32)
                for k in range(extra)}
        shard.columns.update(cols)
        path = tmp_path / f"wide{extra}.h5"
        shard.write(path)
        assert (h5raw.locate(path.read_bytes()) is not None) == fast  # the in-memory layout, or the library's
        with h5py.File(path, "r") as f, h5py.File(plain, "r") as g:
            assert len(f) == 8 + extra
            assert all(f[k][()].tobytes() == v.tobytes() for k, v in cols.items())
            assert all(f[k][()].tobytes() == g[k][()].tobytes() for k in g if k != "header")  # header: its time
        _same_samples(read_shard(path), read_shard(plain))
