"""The trainer side of the seams: the store consumer laid out by the backend's data-parallel layout, stale samples
reaching the trainer as stale items, one advantage pipeline, and lower layers that never import higher ones."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import relax_hpc
from relax_hpc.algorithms.common import step_advantages
from relax_hpc.algorithms.registry import get_algorithm
from relax_hpc.config.load import validate_dict
from relax_hpc.errors import UserError
from relax_hpc.rundir import RunDir
from relax_hpc.store import ConsumerGroup, Sample, SampleGroup, ShardWriter
from relax_hpc.trainer.backend import TrainerBackend
from relax_hpc.trainer.batch import TrainItem
from relax_hpc.trainer.items import samples_to_items
from relax_hpc.trainer.prepare import prepare_items


def group(gid: str, n: int = 4, version: int = 0, length: int = 5) -> SampleGroup:
    return SampleGroup(gid, [Sample(prompt_ids=np.arange(3, dtype=np.int32), response_ids=np.full(length, i, np.int32),
                                    logprobs=np.full(length, -1.0, np.float32), reward=float(i), version=version,
                                    metadata={"uid": f"{gid}/{i}"}) for i in range(n)])


class TensorParallelLayout(TrainerBackend):
    """The layout of a tensor-parallel backend (``tp`` processes per model replica), which cannot run here: only
    its data-parallel attributes are used, by the trainer role's store consumer. Training is not part of it."""

    def __init__(self, rank: int, world_size: int, tp: int):
        self.rank, self.world_size, self.step = rank, world_size, 0
        self.dp_rank, self.dp_size = rank // tp, world_size // tp

    def begin_step(self) -> None: raise NotImplementedError
    def accumulate(self, items: list[TrainItem]) -> None: raise NotImplementedError
    def finish_step(self) -> dict[str, float]: raise NotImplementedError
    def full_state_dict(self, *, copy: bool = False) -> dict[str, Any]: raise NotImplementedError
    def hf_config(self) -> dict[str, Any]: raise NotImplementedError
    def export_hf(self, path: Any, tokenizer: Any) -> None: raise NotImplementedError
    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]: raise NotImplementedError
    def load_checkpoint_state(self, model_sd: Any, optim_sd: Any) -> None: raise NotImplementedError


def test_store_consumer_splits_groups_by_the_backends_data_parallel_layout(tmp_path: Path) -> None:
    from relax_hpc.modes.trainer_role import make_consumer

    rd = RunDir.create(tmp_path / "run")
    cfg = validate_dict({"data": {"task": {"name": "reverse_digits"}}, "model": {"path": "tiny"}})
    writer = ShardWriter(rd, "rollout-0.a")
    for k in range(3):
        writer.write([group(f"s{k}.{j}") for j in range(4)])
    procs = [make_consumer(rd, cfg, TensorParallelLayout(r, 4, tp=2)) for r in range(4)]  # 2 replicas x TP 2
    assert [c.is_leader for c in procs] == [True, False, False, False]
    assert [(c.rank, c.world_size) for c in procs] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    seen: list[str] = []
    for step in range(1, 4):
        plan = procs[0].plan(step, num_groups=4, timeout_s=5)
        for c in procs[1:]:
            c.wait_plan(step, timeout_s=5)
        got = [[s.metadata["uid"] for s in c.read(plan)] for c in procs]
        assert got[0] == got[1] and got[2] == got[3]  # the processes of one replica train on the same samples
        assert got[0] and got[2] and not set(got[0]) & set(got[2])  # replicas get disjoint whole groups
        assert len(got[0]) == len(got[2]) == 8
        seen += got[0] + got[2]
    assert len(seen) == len(set(seen)) == 48  # every sample exactly once
    with pytest.raises(UserError, match="leader"):
        ConsumerGroup(rd, rank=1, world_size=2, leader=True)


def test_stale_flagged_samples_become_stale_items(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    writer = ShardWriter(rd, "rollout-0.a")
    writer.write([group("old", version=1), group("new", version=3)])
    consumer = ConsumerGroup(rd)
    plan = consumer.plan(1, num_groups=2, min_version=2, stale_policy="flag", timeout_s=5)
    items = samples_to_items(consumer.read(plan))
    got = [(it.sample.group_id, it.sample.version, it.sample.stale) for it in items]
    assert got == [("old", 1, True)] * 4 + [("new", 3, False)] * 4


def test_prepare_items_is_step_advantages() -> None:
    """One advantage pipeline: the items the trainer gets carry exactly what algorithms.common.step_advantages says."""
    cfg = validate_dict({"data": {"task": {"name": "reverse_digits"}}, "model": {"path": "tiny"},
                         "rollout": {"sampling": {"max_new_tokens": 10}},
                         "algorithm": {"dynamic_sampling": True,
                                       "overlong": {"enabled": True, "buffer_tokens": 4, "penalty": 1.0}}})
    lengths_in = [3, 3, 3, 3, 2, 8, 10, 12, 5, 9, 1, 4]  # past 6 tokens the overlong penalty starts
    rewards = [0.3, 0.3, 0.3, 0.3, 0.1, 0.7, 0.2, 0.9, 1.0, 1.0, 0.0, 0.55]
    items = [TrainItem.of(prompt_ids=np.arange(2), response_ids=np.arange(lengths_in[i]),
                       logprobs=np.zeros(1), loss_mask=np.ones(1), reward=r, group_id=f"g{i // 4}")
             for i, r in enumerate(rewards)]
    lengths = np.array([len(it.sample.response_ids) for it in items])
    algo = get_algorithm("grpo")
    adv, keep = step_advantages(algo, np.array(rewards), np.array([it.sample.group_id for it in items]), lengths,
                                cfg=cfg.algorithm, max_new_tokens=10)
    prep = prepare_items(items, cfg, algo)
    assert [it.sample.group_id for it in prep.items] == [it.sample.group_id for it, k in zip(items, keep) if k]
    assert [it.advantage for it in prep.items] == [float(a) for a, k in zip(adv, keep) if k]
    assert keep.sum() == 8 and prep.metrics["rollout/dynamic_sampling_dropped"] == 4.0
    assert [it.sample.reward for it in prep.items] == [r for r, k in zip(rewards, keep) if k]  # the task reward


def _imports(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


@pytest.mark.parametrize("package", ["trainer", "algorithms", "store", "weights"])
def test_lower_layers_never_import_higher_ones(package: str) -> None:
    root = Path(relax_hpc.__file__).parent
    higher = ("relax_hpc.modes", "relax_hpc.launch", "relax_hpc.cli", "relax_hpc.monitor", "relax_hpc.bench")
    bad = [f"{p.relative_to(root)}: {m}" for p in sorted((root / package).rglob("*.py"))
           for m in _imports(p) if m.startswith(higher)]
    assert bad == []
