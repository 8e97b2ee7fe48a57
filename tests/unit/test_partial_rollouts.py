"""Partial rollouts' bookkeeping (relax_hpc/rollout/partial.py): the carry buffer (staleness bound, checkpoint state),
the carried-token metrics, the recipe checks, and three steps through the real ``hf`` engine (its slot pool on a
thread of its own, a real store): a group is written once when whole, unfinished groups continue next step from their
tokens (each keeps its version), groups too old are dropped, and every prompt taken is accounted for exactly once."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.bench.lengths import LengthMixEngine
from relax_hpc.config.load import validate_dict
from relax_hpc.config.rollout import PartialConfig
from relax_hpc.config.schema import RewardConfig, SamplingConfig
from relax_hpc.data.dataset import Prompt
from relax_hpc.errors import UserError
from relax_hpc.record import Sample
from relax_hpc.rewards import RewardRunner
from relax_hpc.rollout.driver import RolloutDriver
from relax_hpc.rollout.engine import SamplingParams
from relax_hpc.rollout.hf_engine import HFEngine
from relax_hpc.rollout.partial import CarryBuffer, PartialRollouts, PendingGroup, carry_metrics
from relax_hpc.rundir import RunDir
from tests.helpers.tinymodel import VOCAB, tiny_model


def _sample(versions: list[int], reason: str = "abort") -> Sample:
    n = len(versions)
    return Sample(response_ids=np.ones(n, np.int32), logprobs=np.zeros(n, np.float32),
                  versions=np.asarray(versions, np.int32), finish_reason=reason)


def _prompt(i: int, epoch: int = 0) -> Prompt:
    return Prompt(prompt_ids=[1, 2, 3 + i % 5], answer="12", meta={"index": i, "epoch": epoch})


def test_the_buffer_drops_groups_whose_oldest_token_would_lag_more_than_max_staleness() -> None:
    buf = CarryBuffer(max_staleness=1)
    old = PendingGroup(_prompt(0), "w:0", [_sample([3, 4]), _sample([5], "stop")])
    fresh = PendingGroup(_prompt(1), "w:1", [_sample([4, 5])])
    context_only = PendingGroup(_prompt(2), "w:2", [_sample([-1, -1]), _sample([])])  # no generated token yet
    buf.put([old, fresh, context_only])
    assert [g.carries for g in (old, fresh, context_only)] == [1, 1, 1]
    assert old.oldest_version() == 3 and context_only.oldest_version() is None
    keep, restart, drop = buf.take(5)  # trained at 5: 5 - 3 = 2 > 1
    assert keep == [fresh, context_only] and drop == [old] and restart == [] and len(buf) == 0


def test_the_buffer_state_keeps_prompt_positions_and_a_resume_restarts_them() -> None:
    buf = CarryBuffer(max_staleness=2)
    buf.put([PendingGroup(_prompt(7, epoch=1), "w:0", [_sample([0])]), PendingGroup(_prompt(3), "w:1")])
    state = buf.state()
    assert state == {"prompts": [{"epoch": 1, "index": 7}, {"epoch": 0, "index": 3}]}
    back = CarryBuffer(max_staleness=2)
    back.load_state(state, lambda i: Prompt(prompt_ids=[i], answer="", meta={"index": i}))
    assert [(p.meta["epoch"], p.meta["index"]) for p in back.restart] == [(1, 7), (0, 3)] and back.groups == []
    assert back.state() == state  # restarted prompts not yet started stay in the next checkpoint
    keep, restart, drop = back.take(9)
    assert keep == [] and drop == [] and [p.prompt_ids for p in restart] == [[7], [3]]
    for bad in ({"prompts": [{"epoch": 0}]}, {"prompts": "x"}, [1]):
        with pytest.raises(UserError, match="partial-rollout state"):
            CarryBuffer(max_staleness=1).load_state(bad, lambda i: _prompt(i))


def test_carry_metrics_count_tokens_of_earlier_versions_and_their_age() -> None:
    m = carry_metrics([_sample([2, 2, 3, -1], "stop"), _sample([1, 3], "length")], 3)
    assert m == {"rollout/carried_tokens": 3.0, "rollout/carried_age_mean": pytest.approx(4 / 3),
                 "rollout/staleness_mean": pytest.approx(4 / 5)}
    assert carry_metrics([], 3)["rollout/staleness_mean"] == 0.0


def _recipe(**over: object) -> dict:
    base = {"name": "t", "mode": "colocate", "model": {"path": "tiny"},
            "data": {"task": {"name": "reverse_digits"}}, "rollout": {"partial": {"overprovision": 1.5}}}
    base.update(over)
    return base


def test_the_recipe_checks_partial_rollouts() -> None:
    assert validate_dict(_recipe()).rollout.partial == PartialConfig(overprovision=1.5, carry_over=True)
    assert validate_dict({**_recipe(), "rollout": {}}).rollout.partial is None  # off by default
    with pytest.raises(ValueError, match="only mode colocate"):
        validate_dict(_recipe(mode="fully_async"))
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        validate_dict(_recipe(max_staleness=0))
    validate_dict(_recipe(max_staleness=0, rollout={"partial": {"carry_over": False}}))
    with pytest.raises(ValueError, match="overprovision"):
        validate_dict(_recipe(rollout={"partial": {"overprovision": 0.9}}))


class _Tokenizer:
    eos_token_id = VOCAB  # outside the vocabulary: samples end by their budget only
    pad_token_id = 0

    def decode(self, ids: np.ndarray, skip_special_tokens: bool = True) -> str:
        return "".join(str(int(t) % 10) for t in ids)


class _Law:
    """Each group's response budget (the length mix keys it by the group's id): 3 tokens unless set."""

    cap = 2000

    def __init__(self) -> None:
        self.budgets: dict[str, int] = {}

    def length(self, group_id: str) -> int:
        return self.budgets.get(group_id, 3)

    def describe(self) -> str:
        return "test"


@pytest.fixture
def engine() -> Iterator[HFEngine]:
    e = HFEngine(copy.deepcopy(tiny_model()), _Tokenizer(), SamplingConfig(), batch_prompts=8, seed=0, threads=1,
                 threaded=True, slots=12)
    assert e.slots == 12
    try:
        yield e
    finally:
        e.shutdown()


def test_three_steps_write_each_group_once_carry_the_tail_and_drop_the_too_old(engine: HFEngine,
                                                                                 tmp_path: Path) -> None:
    from relax_hpc.store import ShardWriter, read_shard
    from relax_hpc.store.layout import list_shards, store_paths

    rd = RunDir.create(tmp_path / "run")
    law = _Law()
    law.budgets = {"w:2": 2000, "w:5": 2000}  # still decoding when the others are whole
    driver = RolloutDriver(LengthMixEngine(engine, law), _Tokenizer(),
                           RewardRunner(RewardConfig(name="digits_positional")),
                           sampling=SamplingParams(n=2, temperature=1.0, max_new_tokens=2000), writer_id="w",
                           writer=ShardWriter(rd, "w"))
    partial = PartialRollouts(PartialConfig(overprovision=1.5), prompts_per_step=4, max_staleness=1, driver=driver)
    source = iter(_prompt(i) for i in range(100))
    taken: list[int] = []

    def take(n: int) -> list[Prompt]:
        out = [next(source) for _ in range(n)]
        taken.extend(p.meta["index"] for p in out)
        return out

    try:
        first = partial.step(take)  # groups 0-5: 2 and 5 run long, are aborted and carried
        assert sorted(g.group_id for g in first.groups) == ["w:0", "w:1", "w:3", "w:4"]
        assert first.counts["rollout/partial_aborted_samples"] == 4
        assert [g.group_id for g in partial.buffer.groups] == ["w:2", "w:5"]
        assert all(len(s.response_ids) > 0 for g in partial.buffer.groups for s in g.samples)
        engine.version = 1  # as after a training step
        law.budgets = {"w:2": 1, "w:5": 1, "w:8": 2000}  # 2 and 5 end at once: their prefixes used the budget
        second = partial.step(take)  # 2 and 5 continue (whole at once), 6, 7, 9 whole, 8 long: carried
        ids = sorted(g.group_id for g in second.groups)
        assert {"w:2", "w:5"} <= set(ids) and "w:8" not in ids and len(ids) >= 4
        carried = [s for g in second.groups if g.group_id in ("w:2", "w:5") for s in g.samples]
        assert all(s.version == 0 and s.version_last == 0 for s in carried)  # their tokens keep version 0
        assert second.counts["rollout/carried_tokens"] == sum(len(s.response_ids) for s in carried)
        assert second.counts["rollout/carried_age_mean"] == 1.0
        assert second.counts["rollout/partial_continued_groups"] == 2
        engine.version = 3  # two versions later: group 8's tokens (version 1) would lag 2 > max_staleness
        third = partial.step(take)
        assert third.counts["rollout/partial_dropped_groups"] >= 1
        assert "w:8" not in {g.group_id for g in third.groups}
    finally:
        driver.stopping = True
    folder = store_paths(rd).writer_folder("w")
    stored = [s for ref in list_shards(rd, "w") for s in read_shard(folder / ref.name)]
    by_group: dict[str, set[int]] = {}
    for s in stored:
        by_group.setdefault(s.group_id, set()).add(s.metadata["prompt"]["index"])
    assert all(len(v) == 1 for v in by_group.values()) and all(len(s.response_ids) for s in stored)
    written = [next(iter(v)) for v in by_group.values()]
    buffered = [g.prompt.meta["index"] for g in partial.buffer.groups]
    dropped = sum(r.counts["rollout/partial_dropped_groups"] for r in (first, second, third))
    assert len(written) == len(set(written)) and not set(written) & set(buffered)
    assert set(written) | set(buffered) <= set(taken)
    assert len(taken) == len(written) + len(buffered) + dropped

