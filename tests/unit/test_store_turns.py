"""The ``turns`` column of the shard format: multi-turn samples' turn boundaries written and read back bit for bit
(fast path and HDF5 library, in memory and from the file), shards mixing samples with and without turns, damage
detected, bad boundaries refused before anything is written, and shards written before the column still read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from relax_hpc.errors import CorruptShardError, SampleValidationError
from relax_hpc.rundir import RunDir
from relax_hpc.store import Sample, SampleGroup, ShardWriter, read_shard
from relax_hpc.store.consumer import ConsumerGroup
from relax_hpc.store.shard import encode_shard
from relax_hpc.store.shard_reader import load_small, read_groups
from relax_hpc.trainer.items import samples_to_items

OLD_SHARD = Path(__file__).parent / "data" / "shard-before-turns.h5"
"""Written by the shard code before the ``turns`` column existed (6 samples in 2 groups, ``turns`` in metadata)."""


def episode_sample(rng: np.random.Generator, turns: list[tuple[int, int]] | None, n: int, **extra) -> Sample:
    mask = np.zeros(n, np.uint8)
    for a, b in turns or []:
        mask[a:b] = 1
    return Sample(prompt_ids=rng.integers(0, 150_000, 7).astype(np.int32),
                  response_ids=rng.integers(0, 150_000, n).astype(np.int32), logprobs=-rng.random(n).astype(np.float32),
                  reward=float(rng.standard_normal()), loss_mask=mask,
                  turns=None if turns is None else np.asarray(turns, np.int32).reshape(-1, 2), **extra)


def groups(rng: np.random.Generator, *, tensors: bool = False) -> list[SampleGroup]:
    extra = {"tensors": {"pixel_values": rng.standard_normal((3, 4)).astype(np.float32)}} if tensors else {}
    return [
        SampleGroup("g0", [episode_sample(rng, [(0, 4), (9, 12), (15, 20)], 20, **extra),
                           episode_sample(rng, None, 6), episode_sample(rng, [(0, 3)], 3)]),
        SampleGroup("g1", [episode_sample(rng, [], 0), episode_sample(rng, [(2, 2), (2, 5)], 8)]),
    ]


def same(a: Sample, b: Sample) -> None:
    for name in ("prompt_ids", "response_ids", "logprobs", "loss_mask"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name
    if a.turns is None:
        assert b.turns is None
    else:
        assert b.turns is not None and b.turns.dtype == np.int32 and b.turns.shape == a.turns.shape
        assert b.turns.tobytes() == a.turns.tobytes()
    assert a.reward == b.reward


@pytest.mark.parametrize("tensors", [False, True], ids=["fast-path", "hdf5-library"])
def test_turns_round_trip_bit_for_bit(tmp_path: Path, tensors: bool) -> None:
    rng = np.random.default_rng(1)
    gs = groups(rng, tensors=tensors)
    rd = RunDir.create(tmp_path / "run")
    info = ShardWriter(rd, "rollout-0.t").write(gs)
    want = [s for g in gs for s in g.samples]
    got = read_shard(info.path)
    assert len(got) == len(want) == 5
    for a, b in zip(want, got, strict=True):
        same(a, b)
    small = load_small(info.path, 1 << 22)  # the library-free read of text shards
    if tensors:
        assert small is None
    else:
        assert small is not None and "turns" in small.columns
        res = read_groups(None, small.header, info.path, 0, 2, columns=small.columns)
        for a, b in zip(want, res.samples, strict=True):
            same(a, b)
    c = ConsumerGroup(rd)  # through the consumer group, as the trainer reads
    read = c.read(c.plan(1, num_groups=2, timeout_s=5))
    for a, b in zip(want, sorted(read, key=lambda s: (s.group_id, want.index(next(
            w for w in want if w.prompt_ids.tobytes() == s.prompt_ids.tobytes())))), strict=True):
        same(a, b)
    items = samples_to_items(read)  # carried to the trainer's items
    by_prompt = {it.sample.prompt_ids.tobytes(): it for it in items}
    for s in want:
        t = by_prompt[s.prompt_ids.tobytes()].sample.turns
        assert (t is None) if s.turns is None else t.tobytes() == s.turns.tobytes()


def test_single_turn_shards_are_laid_out_as_before() -> None:
    """No sample with turns: no column, no index section (the layout older readers know)."""
    rng = np.random.default_rng(2)
    enc = encode_shard([SampleGroup("g", [episode_sample(rng, None, 5)])], writer_id="w", seq=0)
    assert "turns" not in enc.header["datasets"] and "turn_counts" not in dict(enc.header["index"])
    enc = encode_shard(groups(rng), writer_id="w", seq=0)
    assert "turns" in enc.header["datasets"] and dict(enc.header["index"])["turn_counts"] == 5


def test_shards_written_before_the_column_still_read(tmp_path: Path) -> None:
    samples = read_shard(OLD_SHARD)
    assert len(samples) == 6 and all(s.turns is None for s in samples)
    assert samples[0].metadata["turns"] == [[0, 2], [3, 5]]  # what the old layout kept in metadata
    assert [s.group_id for s in samples] == ["rollout-0:0"] * 3 + ["rollout-0:1"] * 3
    small = load_small(OLD_SHARD, 1 << 22)
    assert small is not None and "turns" not in small.columns
    res = read_groups(None, small.header, OLD_SHARD, 0, 2, columns=small.columns)
    for a, b in zip(samples, res.samples, strict=True):
        same(a, b)
    assert [it.sample.turns for it in samples_to_items(samples)] == [None] * 6


def test_damaged_turns_column_is_detected(tmp_path: Path) -> None:
    import h5py

    rng = np.random.default_rng(3)
    rd = RunDir.create(tmp_path / "run")
    info = ShardWriter(rd, "rollout-0.d").write(groups(rng))
    with h5py.File(info.path, "r") as f:
        offset = f["turns"].id.get_offset()
    raw = bytearray(info.path.read_bytes())
    raw[offset + 4] ^= 0x01  # group g0's second boundary
    info.path.write_bytes(bytes(raw))
    with pytest.raises(CorruptShardError, match=r"group\(s\) \[0\]"):
        read_shard(info.path)


@pytest.mark.parametrize("turns, message", [
    ([(0, 3), (2, 6)], "ordered, non-overlapping"),
    ([(0, 9)], "within the 6 response tokens"),
    ([(-1, 2)], "ordered, non-overlapping"),
    ([(3, 1)], "ordered, non-overlapping"),
    ([0, 1, 2], r"must be a \[T, 2\] integer array"),
    ([(0.0, 1.5)], r"must be a \[T, 2\] integer array"),
])
def test_bad_turns_are_refused_before_writing(tmp_path: Path, turns: list, message: str) -> None:
    rng = np.random.default_rng(4)
    s = episode_sample(rng, None, 6)
    s.turns = np.asarray(turns)
    rd = RunDir.create(tmp_path / "run")
    with pytest.raises(SampleValidationError, match=rf"group 'g' sample 0: field 'turns' .*{message}"):
        ShardWriter(rd, "rollout-0.b").write([SampleGroup("g", [s])])
    assert not list(rd.writer_shards("rollout-0.b").glob("*.h5"))
