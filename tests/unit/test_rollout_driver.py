"""The rollout driver with the real ``hf`` engine (a tiny Qwen3 built from config), real rewards and a real store:
a sample aborted by a weight update is continued with the new weights (its tokens keep their versions; its stored
version is the oldest); an episode may take several engine calls with environment tokens in between (loss mask 0);
a batch is generated, scored, written, and its admission claim released."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from relax_hpc.config.schema import RewardConfig, SamplingConfig
from relax_hpc.data.dataset import Prompt
from relax_hpc.record import Sample
from relax_hpc.rewards import RewardRunner, RewardScorer
from relax_hpc.rollout.driver import Episode, EpisodeContext, RolloutDriver
from relax_hpc.rollout.engine import SamplingParams
from relax_hpc.rollout.hf_engine import HFEngine
from relax_hpc.rundir import RunDir
from relax_hpc.timing import PhaseTimer
from tests.helpers.engine_conformance import Buckets, check_logprobs, perturbed, prompts
from tests.helpers.tinymodel import VOCAB, tiny_model


class DigitsTokenizer:
    """Token t decodes to the digit t % 10 (the reward compares digit strings)."""

    eos_token_id = VOCAB  # outside the vocabulary: samples end by length or abort only
    pad_token_id = 0

    def decode(self, ids: np.ndarray, skip_special_tokens: bool = True) -> str:
        return "".join(str(int(t) % 10) for t in ids)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[SimpleNamespace]:
    from relax_hpc.store import ShardWriter

    model = tiny_model()
    engine = HFEngine(copy.deepcopy(model), DigitsTokenizer(), SamplingConfig(), batch_prompts=8, seed=0,
                      threads=1)
    rd = RunDir.create(tmp_path / "run")
    ps = [Prompt(prompt_ids=p, answer="1234", meta={"index": i}) for i, p in enumerate(prompts(VOCAB))]

    def driver(sampling: SamplingParams, **kw: object) -> RolloutDriver:
        return RolloutDriver(engine, DigitsTokenizer(), RewardRunner(RewardConfig(name="digits_positional")),
                             sampling=sampling, writer_id="rollout-0.test", writer=ShardWriter(rd, "rollout-0.test"),
                             **kw)
    try:
        yield SimpleNamespace(model=model, engine=engine, rd=rd, prompts=ps, driver=driver)
    finally:
        engine.shutdown()


def stored(rd: RunDir) -> list:
    from relax_hpc.store import read_shard
    from relax_hpc.store.layout import list_shards, store_paths

    return [s for ref in list_shards(rd, "rollout-0.test")
            for s in read_shard(store_paths(rd).writer_folder("rollout-0.test") / ref.name)]


def test_sample_aborted_by_a_weight_update_continues_with_the_new_weights(setup: SimpleNamespace) -> None:
    budget = 1500
    d = setup.driver(SamplingParams(n=2, temperature=1.0, max_new_tokens=budget))
    new = perturbed(setup.model, 1)

    async def go() -> list[list[Sample]]:
        task = asyncio.ensure_future(d.rollout(setup.prompts))
        await asyncio.sleep(0.3)
        assert not task.done()
        await setup.engine.pause(abort=True)
        await setup.engine.receive(1, Buckets(new))
        await setup.engine.resume()
        return await asyncio.wait_for(task, 120)

    trajs = d.call(go())
    assert [len(g) for g in trajs] == [2, 2, 2]
    for p, group in zip(setup.prompts, trajs):
        for t in group:
            assert t.finish_reason == "length" and len(t.response_ids) == budget and t.engine_calls == 2
            assert (t.loss_mask == 1).all() and t.versions[0] == 0 and t.versions[-1] == 1
            assert (np.diff(t.versions) >= 0).all()
            old = int((t.versions == 0).sum())
            check_logprobs(setup.model, p.prompt_ids, t.response_ids[:old], t.logprobs[:old], 1.0)
    from relax_hpc.rollout.driver import build_groups

    groups, counts = build_groups(setup.prompts, trajs, d.score(setup.prompts, trajs), writer_id=d.writer_id,
                                  counter=0, default_version=1)
    d.writer.write(groups)
    samples = stored(setup.rd)
    assert len(samples) == 6 and counts["rollout/groups_dropped_reward_error"] == 0
    assert all(s.version == 0 and s.version_first == 0 and s.version_last == 1 for s in samples)  # staleness: oldest


class ToolEpisode(Episode):
    """Two turns: the model's answer, an environment reply (3 tokens, not trained on), the model again."""

    async def run_sample(self, ctx: EpisodeContext, prompt: Prompt, traj: Sample, index: int) -> Sample:
        traj.append_context([5, 6, 7])
        traj.extend(await ctx.continue_sample(prompt, traj, new_tokens=4))
        traj.metadata["turns"] = 2
        return traj


def test_multi_turn_episode_masks_environment_tokens(setup: SimpleNamespace) -> None:
    d = setup.driver(SamplingParams(n=2, temperature=1.0, max_new_tokens=3), episode=ToolEpisode())
    res = d.run_batch(setup.prompts[:2])
    assert len(res.groups) == 2 and res.samples == 4
    for p, group in zip(setup.prompts, res.generated):
        for t in group:
            assert len(t.response_ids) == 3 + 3 + 4 and t.engine_calls == 2
            assert t.loss_mask.tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 1, 1]
            assert t.versions[3:6].tolist() == [-1, -1, -1] and t.response_ids[3:6].tolist() == [5, 6, 7]
            gen = t.loss_mask == 1
            full = np.asarray(p.prompt_ids + t.response_ids.tolist())
            # the second turn's log-probs are the model's, after the prompt, the first turn and the reply
            check_logprobs(setup.model, full[:len(p.prompt_ids) + 6].tolist(), t.response_ids[6:], t.logprobs[6:], 1.0)
            assert (t.logprobs[~gen] == 0).all()
    samples = stored(setup.rd)
    assert all(s.loss_mask.tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 1, 1] for s in samples)
    assert all(s.metadata["turns"] == 2 and s.metadata["finish_reason"] == "length" for s in samples)


def test_run_batch_writes_groups_and_releases_the_claim(setup: SimpleNamespace) -> None:
    from relax_hpc.rollout.admission import Admission

    adm = Admission(setup.rd, "rollout-0", limit=16)
    d = setup.driver(SamplingParams(n=3, temperature=1.0, max_new_tokens=5), admission=adm)
    assert adm.try_claim(3, lambda: 0) and adm.path.exists()
    timer = PhaseTimer()
    res = d.run_batch(setup.prompts, timer)
    assert not adm.path.exists() and adm.held == 0
    assert all(timer.get(k) > 0 for k in RolloutDriver.PHASES)
    assert [g.group_id for g in res.groups] == ["rollout-0.test:0", "rollout-0.test:1", "rollout-0.test:2"]
    samples = stored(setup.rd)
    assert len(samples) == 9 and all(len(s.response_ids) == 5 for s in samples)
    texts = [DigitsTokenizer().decode(s.response_ids) for s in samples]
    want = RewardRunner(RewardConfig(name="digits_positional")).score(texts, ["1234"] * 9).rewards
    assert [s.reward for s in samples] == pytest.approx(list(want))
    assert d.counter == 3
    res2 = d.run_batch(setup.prompts[:1])
    assert res2.groups[0].group_id == "rollout-0.test:3"


def test_version_spans_equal_each_samples_version_range() -> None:
    """The batch-level spans (one concatenation, two segment reductions) give what ``version_range`` gives per
    sample: empty samples, context tokens (-1) only, context tokens among generated ones, versions not in
    order, no per-token versions at all."""
    from relax_hpc.rollout.driver import version_spans

    rng = np.random.default_rng(0)
    for _ in range(300):
        trajs = [Sample(versions=rng.integers(-1, 5, size=int(rng.integers(0, 7))).astype(np.int32))
                 for _ in range(int(rng.integers(0, 10)))] + [Sample()]
        firsts, lasts = version_spans(trajs, 7)
        assert list(zip(firsts, lasts)) == [t.version_range(7) for t in trajs]
    assert version_spans([Sample(versions=np.array([-1, -1], np.int32)), Sample()], 3) == ([3, 3], [3, 3])


class CountingReward(RewardScorer):
    """A reward that declares only ``score``: the driver relies on the interface's defaults for the rest."""

    def __init__(self) -> None:
        self.calls = 0

    def score(self, responses, answers, metas=None):  # type: ignore[no-untyped-def]
        from relax_hpc.rewards.runner import RewardResult

        self.calls += 1
        n = len(responses)
        return RewardResult(np.arange(n, dtype=np.float32), {"length": np.asarray([len(r) for r in responses],
                                                                                   np.float32)},
                            np.zeros(n, bool), [None] * n, np.zeros(n, bool))


class SelfScoringEpisode(Episode):
    """Sets each sample's reward itself and reports a metric: the driver's reward is not asked."""

    def __init__(self) -> None:
        self.batches = 0

    def score(self, prompts, groups):  # type: ignore[no-untyped-def]
        from relax_hpc.rewards.runner import RewardResult

        flat = [s for g in groups for s in g]
        for s in flat:
            s.reward = 0.25
        n = len(flat)
        return RewardResult(np.full(n, 0.25, np.float32), {}, np.zeros(n, bool), [None] * n, np.zeros(n, bool))

    def take_metrics(self) -> dict[str, float]:
        self.batches += 1
        return {"episode/batches": float(self.batches)}


def test_the_record_generated_is_the_record_stored_and_read(setup: SimpleNamespace) -> None:
    """The driver writes the samples it generated (the same objects: reward, parts, versions and group set in
    place), and the store reads them back as the same class; a reward declaring only ``score`` works through the
    interface's defaults (no ``metrics``, no ``score_async``)."""
    reward = CountingReward()
    d = RolloutDriver(setup.engine, DigitsTokenizer(), reward, sampling=SamplingParams(n=2, max_new_tokens=4),
                      writer_id="rollout-0.test", writer=d_writer(setup.rd))
    res = d.run_batch(setup.prompts[:2])
    assert reward.calls == 1 and res.counts["rollout/groups_dropped_reward_error"] == 0
    assert [s for g in res.groups for s in g.samples] == [s for g in res.generated for s in g]  # the same objects
    for i, g in enumerate(res.groups):
        for j, s in enumerate(g.samples):
            assert type(s) is Sample and s.group_id == g.group_id and s.reward == 2 * i + j
            assert s.rewards == {"length": 4.0} and s.engine_calls == 1 and s.versions.tolist() == [0] * 4
    back = stored(setup.rd)
    assert {type(s) for s in back} == {Sample}
    assert [s.reward for s in back] == [0.0, 1.0, 2.0, 3.0] and all(s.rewards == {"length": 4.0} for s in back)
    assert [s.response_ids.tolist() for s in back] == [s.response_ids.tolist() for g in res.generated for s in g]


def test_an_episode_that_scores_itself_needs_no_reward(setup: SimpleNamespace) -> None:
    episode = SelfScoringEpisode()
    d = RolloutDriver(setup.engine, DigitsTokenizer(), None, sampling=SamplingParams(n=2, max_new_tokens=3),
                      writer_id="rollout-0.test", writer=d_writer(setup.rd), episode=episode)
    res = d.run_batch(setup.prompts[:2])
    assert res.counts["episode/batches"] == 1.0 and res.reward_errors == 0
    assert [s.reward for s in stored(setup.rd)] == [0.25] * 4
    plain = RolloutDriver(setup.engine, DigitsTokenizer(), None, sampling=SamplingParams(n=1, max_new_tokens=3),
                          writer_id="rollout-0.plain")
    with pytest.raises(ValueError, match="no reward"):
        plain.run_batch(setup.prompts[:1])


def d_writer(rd: RunDir):  # type: ignore[no-untyped-def]
    from relax_hpc.store import ShardWriter

    return ShardWriter(rd, "rollout-0.test")


def test_the_driver_probes_no_capability() -> None:
    """What the driver needs of an episode and of a reward is declared on their interfaces: no ``getattr`` or
    ``hasattr`` in rollout/driver.py."""
    import ast

    import relax_hpc.rollout.driver as mod

    tree = ast.parse(Path(mod.__file__).read_text())
    probes = [n.lineno for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")]
    assert probes == []


def test_seed_derivation_is_the_same_in_every_process() -> None:
    """An episode's environment seed comes from its request id the same way in every process (Python's ``hash``
    of a string is salted per process: seeds derived from it made multi-turn runs irreproducible)."""
    import os
    import subprocess
    import sys

    from relax_hpc.rollout.driver import derive_seed

    code = ("from relax_hpc.rollout.driver import EpisodeContext, SamplingParams;"
            "c = EpisodeContext(None, SamplingParams(n=4), 'rollout-0.a:17');"
            "print([c.seed(j) for j in range(4)])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                           env={**os.environ, "PYTHONHASHSEED": h}).stdout for h in ("1", "2")}
    base = derive_seed(None, "rollout-0.a:17", 0)
    assert outs == {f"{[base + j for j in range(4)]}\n"}
    assert derive_seed(5, "rollout-0.a:17", 2) == 7  # a seed in the sampling settings fixes it
