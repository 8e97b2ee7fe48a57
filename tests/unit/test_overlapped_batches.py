"""A fully_async worker starts its next batch while the batch in flight decodes its tail
(``RolloutDriver.start_batch`` / ``finish_batch``): with the real ``hf`` engine and its slot pool, the next batch's
rows take the slots the tail leaves, so decode occupancy rises against one batch at a time on the same length mix;
each batch is written once, in order, and releases only its own part of the admission claim."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from relax_hpc.bench.lengths import LengthMixEngine
from relax_hpc.config.schema import RewardConfig, SamplingConfig
from relax_hpc.data.dataset import Prompt
from relax_hpc.rewards import RewardRunner
from relax_hpc.rollout.admission import Admission
from relax_hpc.rollout.driver import RolloutDriver
from relax_hpc.rollout.engine import SamplingParams
from relax_hpc.rollout.hf_engine import HFEngine
from relax_hpc.rundir import RunDir
from tests.helpers.tinymodel import VOCAB, tiny_model


class _Tokenizer:
    eos_token_id = VOCAB  # outside the vocabulary: samples end by their budget only
    pad_token_id = 0

    def decode(self, ids: np.ndarray, skip_special_tokens: bool = True) -> str:
        return "".join(str(int(t) % 10) for t in ids)


class _Law:
    """In every batch of four prompts, the first runs 32 tokens and the others 3 (the driver's group ids count
    prompts from 0)."""

    cap = 32

    def length(self, group_id: str) -> int:
        return 32 if int(group_id.rsplit(":", 1)[1]) % 4 == 0 else 3

    def describe(self) -> str:
        return "test"


def _run(tmp_path: Path, name: str, overlapped: bool) -> tuple[float, list[list[str]], Admission]:
    from relax_hpc.store import ShardWriter, read_shard
    from relax_hpc.store.layout import list_shards, store_paths

    rd = RunDir.create(tmp_path / name)
    engine = HFEngine(copy.deepcopy(tiny_model()), _Tokenizer(), SamplingConfig(), batch_prompts=4, seed=0,
                      threads=1, threaded=True, slots=8)
    admission = Admission(rd, "rollout-0", limit=16)
    driver = RolloutDriver(LengthMixEngine(engine, _Law()), _Tokenizer(),
                           RewardRunner(RewardConfig(name="digits_positional")),
                           sampling=SamplingParams(n=2, temperature=1.0, max_new_tokens=32), writer_id="w",
                           writer=ShardWriter(rd, "w"), admission=admission)
    batches = [[Prompt(prompt_ids=[1, 2, 3 + b], answer="12", meta={"index": 4 * b + i}) for i in range(4)]
               for b in range(3)]
    try:
        if overlapped:  # as the worker does when there is room: the next batch starts before this one ends
            assert admission.try_claim(4, lambda: 0)
            pending = driver.start_batch(batches[0], claimed=4)
            for nxt in batches[1:]:
                assert admission.try_claim(4, lambda: 0, more=True)
                started = driver.start_batch(nxt, claimed=4)
                driver.finish_batch(pending)
                assert admission.held == 4  # only the written batch's part was released
                pending = started
            driver.finish_batch(pending)
        else:
            for batch in batches:
                assert admission.try_claim(4, lambda: 0)
                driver.run_batch(batch)
        occupancy = engine.metrics()["perf/decode_occupancy"]
    finally:
        engine.shutdown()
    folder = store_paths(rd).writer_folder("w")
    shards = [[s.group_id for s in read_shard(folder / ref.name)][::2] for ref in list_shards(rd, "w")]
    return occupancy, shards, admission


def test_the_next_batch_fills_the_slots_the_tail_leaves(tmp_path: Path) -> None:
    alone, shards_alone, _ = _run(tmp_path, "alone", overlapped=False)
    overlapped, shards, admission = _run(tmp_path, "overlapped", overlapped=True)
    want = [[f"w:{4 * b + i}" for i in range(4)] for b in range(3)]
    assert shards == shards_alone == want  # each batch written once, in order, as one shard
    assert admission.held == 0 and not admission.path.exists()
    # one batch at a time: the long rows decode alone for 29 of 32 steps; overlapped, the next batch's rows run then
    assert alone < 0.4 and overlapped > alone + 0.08, (alone, overlapped)
