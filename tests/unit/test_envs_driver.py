"""Episodes in the rollout driver with the real ``hf`` engine (tiny Qwen3, the built-in digits tokenizer): many
episodes in flight share the engine, a weight update mid-episode continues the interrupted turns under the new
weights with every token keeping its version, and the groups reach the store with their own prompts and turns."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import numpy as np

from relax_hpc.config.load import validate_dict
from relax_hpc.config.schema import SamplingConfig
from relax_hpc.data.dataset import Prompt
from relax_hpc.envs.driver_episode import EnvEpisode
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
from relax_hpc.rollout.driver import RolloutDriver
from relax_hpc.rollout.engine import SamplingParams
from relax_hpc.rollout.hf_engine import HFEngine
from relax_hpc.rundir import RunDir
from tests.helpers.engine_conformance import Buckets, perturbed


def _episodes_across_updates(tmp_path: Path, delay_s: float) -> bool:
    """One rollout of 8 x 4 episodes with two weight updates while they run. Checks every invariant; returns whether
    an update caught a turn in flight (a race with the engine's speed, so the test tries a few times)."""
    from relax_hpc.store import ShardWriter, read_shard
    from relax_hpc.store.layout import list_shards, store_paths

    cfg = validate_dict({"data": {"task": {"name": "copy_digits"}}, "rollout": {"n_samples": 4, "env": {
        "name": "digit_lookup", "tool_parser": "relax_hpc.envs.builtin.lookup:DigitCallParser", "max_turns": 3,
        "max_turn_tokens": 40, "max_total_tokens": 200}}})
    tok = build_digits_tokenizer()
    model = build_tiny_model(cfg.model.tiny, len(tok), pad_token_id=tok.pad_token_id)
    engine = HFEngine(copy.deepcopy(model), tok, SamplingConfig(), batch_prompts=2, seed=0, threads=1)
    episode = EnvEpisode(cfg, tok)
    rd = RunDir.create(tmp_path / "run")
    driver = RolloutDriver(engine, tok, None, sampling=SamplingParams(n=4, temperature=1.0, max_new_tokens=40),
                           writer_id="rollout-0.t", writer=ShardWriter(rd, "rollout-0.t"), episode=episode)
    prompts = [Prompt(prompt_ids=[], answer=None, meta={}, raw=f"{i:02d}") for i in range(8)]

    later_turns = []
    first_turns = []
    generate = engine.generate

    async def counting(req):  # the real engine; only counts the requests of each turn
        if ".t0/" in req.request_id:
            first_turns.append(req.request_id)
        else:
            later_turns.append(req.request_id)
        return await generate(req)

    engine.generate = counting  # type: ignore[method-assign]

    async def update(version: int) -> None:
        await engine.pause(abort=True)
        await engine.receive(version, Buckets(perturbed(model, version)))
        await engine.resume()

    async def go():
        task = asyncio.ensure_future(driver.rollout(prompts))
        while not first_turns and not task.done():  # the update lands while the first turns are generating
            await asyncio.sleep(0.001)
        await asyncio.sleep(delay_s)
        await update(1)  # first turns in flight: aborted, continued under v1
        seen = len(later_turns)
        while len(later_turns) < seen + 3 and not task.done():  # episodes past a turn: the next lands mid-episode
            await asyncio.sleep(0.005)
        await update(2)
        return await asyncio.wait_for(task, 300)

    try:
        generated = driver.call(go())
        stats = list(episode.stats)
        assert len(stats) == 32 and all(s.error is None for s in stats)
        if sum(s.aborted_turns for s in stats) == 0:
            return False  # both updates fell between turns: nothing to check about straddling tokens
        both = 0
        for group in generated:
            for t in group:
                gen = t.versions[t.loss_mask.astype(bool)]
                assert (np.diff(gen) >= 0).all() and set(gen.tolist()) <= {0, 1, 2}
                assert (t.versions[~t.loss_mask.astype(bool)] == -1).all()
                assert int(t.loss_mask.sum()) == sum(b - a for a, b in t.turns)
                both += int(len(gen) > 0 and gen.min() < gen.max())
        if both == 0:
            return False
        from relax_hpc.rollout.driver import build_groups

        groups, _ = build_groups(prompts, generated, episode.score(prompts, generated), writer_id="rollout-0.t",
                                 counter=0, default_version=1)
        driver.writer.write(groups)
        samples = [s for ref in list_shards(rd, "rollout-0.t")
                   for s in read_shard(store_paths(rd).writer_folder("rollout-0.t") / ref.name)]
        assert len(samples) == 32
        assert all(len(s.prompt_ids) > 0 and s.turns is not None and len(s.turns) for s in samples)  # own prompts
        flat = [t for g in generated for t in g]  # the turn-boundary column reads back bit for bit
        assert sorted(s.turns.tobytes() for s in samples) == sorted(t.turns.astype(np.int32).tobytes() for t in flat)
        m = episode.take_metrics()
        assert m["agent/episodes"] == 32 and m["agent/aborted_turns"] > 0
        return True
    finally:
        engine.shutdown()


def test_weight_update_mid_episode_with_the_hf_engine(tmp_path: Path) -> None:
    delays = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)  # how long the engine has run before the update
    caught = [_episodes_across_updates(tmp_path / f"try{k}", d) for k, d in enumerate(delays)]
    assert any(caught), "no weight update caught a turn in flight in 8 rollouts"
