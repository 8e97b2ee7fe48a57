"""Sharded checkpoints (relax_hpc.trainer.checkpoint, the session's dispatch) with a stand-in format whose ranks
write small files: the published layout, the leader waiting for every rank's part (and its timeout), a half-written
or damaged checkpoint passed over, retention and debris, the RNG states, and the session choosing the format once
(the megatron one is tests/integration/test_megatron_checkpoint.py)."""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from relax_hpc.errors import UserError, WaitTimeout
from relax_hpc.events import EventLog
from relax_hpc.rundir import RunDir
from relax_hpc.trainer import checkpoint as ckpt
from relax_hpc.trainer.backend import ShardedCheckpoint
from relax_hpc.trainer.checkpoint import (
    checkpoint_problem,
    latest_checkpoint,
    load_sharded_checkpoint,
    read_checkpoint_state,
    save_sharded_checkpoint,
)
from relax_hpc.trainer.session import TrainerSession
from tests.helpers.backend_conformance import make_cfg


class Stand(ShardedCheckpoint):
    """Each rank writes ``rank<r>.bin`` (its 'shards'); ``load`` records the folder it was given."""

    name = "stand"
    elsewhere = "convert it first"

    def __init__(self, rank: int = 0, *, active: bool = True, tokens: int = 40):
        self.rank, self.active, self.tokens = rank, active, tokens
        self.loaded: list[Path] = []
        self.closed = False

    def layout(self) -> dict[str, Any]:
        return {"trainer.micro_batch_tokens": self.tokens}

    def save(self, folder: Path) -> None:
        assert folder.is_dir() and not (folder / f"rank{self.rank}.bin").exists()
        (folder / f"rank{self.rank}.bin").write_bytes(bytes([self.rank]) * (10 + self.rank))

    def load(self, folder: Path) -> None:
        assert {p.name for p in folder.iterdir()} >= {"rank0.bin"}
        self.loaded.append(folder)

    def close(self) -> None:
        self.closed = True


def _save(rd: RunDir, step: int, stand: Stand, **kw: Any) -> Path | None:
    args: dict[str, Any] = {"rank": stand.rank, "world_size": 1, "state": {"version": step, "data": {"i": step}},
                            "keep": 2, "timeout_s": 5.0, **kw}
    return save_sharded_checkpoint(rd, step, stand, **args)


def test_one_rank_publishes_the_layout_and_loads_it_back(rd: RunDir) -> None:
    random.seed(3)
    torch.manual_seed(3)
    path = _save(rd, 2, Stand())
    assert path == rd.checkpoint(2) and rd.checkpoints_latest.read_text() == "2\n"
    assert sorted(p.name for p in path.iterdir()) == ["COMPLETE", "rng.safetensors", "stand", "state.json"]
    state = read_checkpoint_state(path)
    assert state["sharded"] == {"format": "stand", "layout": {"trainer.micro_batch_tokens": 40},
                                "elsewhere": "convert it first", "world_size": 1, "files": {"stand/rank0.bin": 10}}
    assert (state["step"], state["version"], state["data"]) == (2, 2, {"i": 2})
    assert checkpoint_problem(path) is None and not rd.checkpoint_staging(2).exists()
    want = (random.random(), torch.rand(3))
    random.seed(99)
    torch.manual_seed(99)
    stand = Stand()
    load_sharded_checkpoint(path, state, stand)
    assert stand.loaded == [path / "stand"]
    got = (random.random(), torch.rand(3))
    assert got[0] == want[0] and torch.equal(got[1], want[1])  # the RNG states of the save


def test_two_ranks_publish_once_both_parts_are_in(rd: RunDir, monkeypatch: pytest.MonkeyPatch) -> None:
    barrier = threading.Barrier(2)
    monkeypatch.setattr(ckpt, "_barrier", lambda world_size: barrier.wait(timeout=10))
    results: dict[int, Any] = {}

    def rank(r: int) -> None:
        if r == 1:
            time.sleep(0.3)  # the leader waits for this part
        results[r] = _save(rd, 4, Stand(r), world_size=2)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert results == {0: rd.checkpoint(4), 1: None}
    files = read_checkpoint_state(rd.checkpoint(4))["sharded"]["files"]
    assert files == {"stand/rank0.bin": 10, "stand/rank1.bin": 11}
    assert not list(rd.checkpoint(4).glob("part-r*.json"))


def test_a_missing_part_times_out_and_leaves_the_previous_checkpoint(rd: RunDir,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _save(rd, 2, Stand())
    monkeypatch.setattr(ckpt, "_barrier", lambda world_size: None)
    with pytest.raises(WaitTimeout, match=r"ranks \[1\] never finished writing; the checkpoint is not published"):
        _save(rd, 4, Stand(0), world_size=2, timeout_s=0.3)
    assert not rd.checkpoint(4).exists() and (rd.checkpoint_staging(4) / "part-r00000.json").is_file()
    assert rd.checkpoints_latest.read_text() == "2\n" and latest_checkpoint(rd) == rd.checkpoint(2)
    _save(rd, 4, Stand())  # the same step again: the stale staging is cleared first
    assert latest_checkpoint(rd) == rd.checkpoint(4)
    assert read_checkpoint_state(rd.checkpoint(4))["sharded"]["world_size"] == 1


def test_a_damaged_checkpoint_is_passed_over(rd: RunDir) -> None:
    _save(rd, 2, Stand())
    _save(rd, 4, Stand())
    shard = rd.checkpoint(4) / "stand" / "rank0.bin"
    shard.write_bytes(b"short")
    assert "5 bytes, state.json recorded 10" in (checkpoint_problem(rd.checkpoint(4)) or "")
    shard.unlink()
    assert "a rank's shards are missing" in (checkpoint_problem(rd.checkpoint(4)) or "")
    assert latest_checkpoint(rd) == rd.checkpoint(2)
    rng = rd.checkpoint(2) / "rng.safetensors"
    data = bytearray(rng.read_bytes())
    data[-1] ^= 0xFF
    rng.write_bytes(bytes(data))
    assert "checksum mismatch" in (checkpoint_problem(rd.checkpoint(2)) or "")
    assert latest_checkpoint(rd) is None


def test_retention_keeps_the_newest_and_clears_old_debris(rd: RunDir) -> None:
    old = rd.checkpoint_staging(1)
    old.mkdir(parents=True)
    past = time.time() - 7200
    os.utime(old, (past, past))
    for step in (2, 4, 6):
        _save(rd, step, Stand())
    assert sorted(p.name for p in rd.checkpoints.iterdir()) == ["LATEST", "step_00000004", "step_00000006"]


class Stub:
    """A one-rank trainer whose state is one tensor; ``sharded`` is what it offers the session."""

    rank, world_size, dp_rank, dp_size = 0, 1, 0, 1

    def __init__(self, sharded: Stand | None):
        self.sharded, self.step, self.w = sharded, 0, torch.arange(4.0)

    def sharded_checkpoint(self) -> Stand | None:
        return self.sharded

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"w": self.w.clone()}, {"state": {}, "param_groups": []}

    def load_checkpoint_state(self, model_sd: dict[str, Any], optim_sd: Any) -> None:
        self.w = model_sd["w"]


def _session(rd: RunDir, trainer: Stub, **trainer_cfg: Any) -> TrainerSession:
    cfg = make_cfg(trainer={"keep_checkpoints": 3, **trainer_cfg})
    return TrainerSession(rd, cfg, trainer, None, EventLog(rd, "trainer", 0))  # type: ignore[arg-type]


def test_the_session_takes_the_format_once_and_reads_either(rd: RunDir) -> None:
    full = Stub(Stand(active=False))
    s = _session(rd, full)
    full.step, full.w = 2, torch.ones(4)
    s.checkpoint({"store_position": {}})
    assert "sharded" not in read_checkpoint_state(rd.checkpoint(2))  # inactive: the gathered format
    sharded = Stub(Stand())
    s = _session(rd, sharded)
    assert s.resume() is not None and torch.equal(sharded.w, torch.ones(4))  # a full checkpoint, either way
    sharded.step = 4
    committed: list[int] = []
    s.checkpoint({"store_position": {}}, on_saved=lambda: committed.append(4), background=True)
    assert committed == [4] and read_checkpoint_state(rd.checkpoint(4))["sharded"]["format"] == "stand"
    s.close()
    assert sharded.sharded is not None and sharded.sharded.closed
    again = Stub(Stand(active=False))
    assert _session(rd, again).resume()["step"] == 4 and again.sharded.loaded == [rd.checkpoint(4) / "stand"]
    events = (rd.event_log("trainer-0")).read_text()
    assert '"checkpoint_saved"' in events


def test_a_sharded_checkpoint_another_trainer_cannot_read_is_one_error(rd: RunDir) -> None:
    _save(rd, 2, Stand())
    with pytest.raises(UserError, match=r"step_00000002 is a 'stand' sharded checkpoint, which loads only with "
                                        r"trainer\.micro_batch_tokens: 40 \(this trainer has no reader for it "
                                        r"here\); "
                                        r"resume with those settings, or convert it first$"):
        _session(rd, Stub(None)).resume()
    with pytest.raises(UserError, match=r"loads only with trainer\.micro_batch_tokens: 40 \(this run has "
                                        r"trainer\.micro_batch_tokens: 64\)"):
        _session(rd, Stub(Stand(tokens=64)), micro_batch_tokens=64).resume()


def test_a_checkpoint_of_another_backend_is_named_by_the_backend_alone(rd: RunDir) -> None:
    """A torch run has no ``trainer.megatron`` section: the error names the backend setting, not every megatron
    setting as null."""

    class Megatron(Stand):
        def layout(self) -> dict[str, Any]:
            return {"trainer.backend": "megatron", "trainer.megatron.tp": 1, "trainer.megatron.pp": 1}

    _save(rd, 2, Megatron())
    with pytest.raises(UserError) as err:
        _session(rd, Stub(Stand())).resume()
    assert 'loads only with trainer.backend: "megatron" (this run has trainer.backend: "torch"); ' in str(err.value)
    assert "megatron.tp" not in str(err.value) and "\n" not in str(err.value)
