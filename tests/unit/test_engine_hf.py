"""The ``hf`` engine passes the engine conformance suite, on its decoders (its own sampling loop,
``transformers.generate``, and the slot pool of an engine with its own thread: 6 slots, fewer than some tests'
rows, so slots are reused), with a real tiny Qwen3 model built from config; plus what only an in-process engine has:
the shared module of colocate, a bucket stream that lacks tensors, and an engine that loads its own model."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from relax_hpc.config.schema import SamplingConfig
from relax_hpc.rollout.engine import GenerateRequest, SamplingParams, SharedModule
from relax_hpc.rollout.hf_engine import HFEngine
from relax_hpc.rundir import RunDir
from tests.helpers.engine_conformance import *  # noqa: F403 - the suite's tests run here
from tests.helpers.engine_conformance import Buckets, Harness, perturbed, prompts, run
from tests.helpers.tinymodel import VOCAB, tiny_model


def tokenizer() -> SimpleNamespace:
    return SimpleNamespace(eos_token_id=VOCAB, pad_token_id=0)  # EOS outside the vocabulary: never sampled


@pytest.fixture(params=[("auto", True, 0), ("generate", True, 0), ("auto", False, 0), ("auto", True, 6)],
                ids=["loop", "generate", "loop-unthreaded", "slots"])
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    decoder, threaded, slots = request.param
    model = tiny_model()
    engine = HFEngine(copy.deepcopy(model), tokenizer(), SamplingConfig(), batch_prompts=8, seed=0,
                      decoder=decoder, threads=1, threaded=threaded, slots=slots)
    assert engine.slots == slots
    try:
        yield Harness(engine=engine, model=model, run_dir=RunDir.create(tmp_path / "run"), vocab=VOCAB,
                      concurrent=threaded)
    finally:
        engine.shutdown()


def test_shared_module_only_changes_the_version() -> None:
    model = tiny_model()
    shared = HFEngine(model, tokenizer(), SamplingConfig(), shared=True, threads=1)
    own = HFEngine(copy.deepcopy(model), tokenizer(), SamplingConfig(), threads=1)
    try:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        run(shared.receive(7, SharedModule()))
        assert shared.version == 7
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        with pytest.raises(ValueError, match="not the trainer's"):
            run(own.receive(3, SharedModule()))
        assert own.version == 0
    finally:
        shared.shutdown()
        own.shutdown()


def test_bucket_stream_that_lacks_tensors_is_refused() -> None:
    from relax_hpc.errors import SnapshotError

    model = tiny_model()
    eng = HFEngine(copy.deepcopy(model), tokenizer(), SamplingConfig(), threads=1)
    try:
        part = {k: v for k, v in perturbed(model, 5).items() if "layers.1." not in k}
        with pytest.raises(SnapshotError, match="lacks"):
            run(eng.receive(4, Buckets(part)))
        assert eng.version == 0
        with pytest.raises(SnapshotError, match="does not have"):
            run(eng.receive(4, Buckets({"nope.weight": torch.zeros(2)})))
    finally:
        eng.shutdown()


def test_make_engine_without_a_model_loads_its_own() -> None:
    from relax_hpc.config.load import validate_dict
    from relax_hpc.models.load import load_tokenizer
    from relax_hpc.rollout.factory import make_engine

    cfg = validate_dict({"data": {"task": {"name": "reverse_digits"}}, "model": {"path": "tiny"},
                         "rollout": {"device": "cpu", "sampling": {"max_new_tokens": 5}}})
    tok = load_tokenizer(cfg.model)
    eng = make_engine(cfg, seed=3, tokenizer=tok)
    try:
        assert isinstance(eng, HFEngine) and not eng.shared
        assert eng.weight_template() is not None
        out = run(eng.generate(GenerateRequest("x", tok.encode("12"), SamplingParams(n=2, max_new_tokens=5))))
        assert len(out.samples) == 2 and all(1 <= len(s.token_ids) <= 5 for s in out.samples)
        assert run(eng.health()).ok
        run(eng.close())
        assert not run(eng.health()).ok
    finally:
        eng.shutdown()


def test_engine_seed_makes_batches_reproducible() -> None:
    model = tiny_model()

    def first_batch(seed: int) -> list[list[int]]:
        eng = HFEngine(model, tokenizer(), SamplingConfig(max_new_tokens=6), seed=seed, threads=1)
        reqs = [GenerateRequest(f"r{i}", p, SamplingParams(n=2, max_new_tokens=6))
                for i, p in enumerate(prompts(VOCAB))]

        async def go() -> list[list[int]]:
            from relax_hpc.rollout.engine import generate_all

            out = await generate_all(eng, reqs)
            return [s.token_ids.tolist() for r in out for s in r.samples]
        try:
            return asyncio.run(go())
        finally:
            eng.shutdown()

    a, b, c = first_batch(11), first_batch(11), first_batch(12)
    assert a == b and a != c
    assert np.asarray(a).shape == (6, 6)


def test_unthreaded_engine_acts_on_pause_and_abort_between_batches() -> None:
    """Colocate's engine has no thread: a request made while it is paused waits for resume; an aborted request
    that is still queued ends at once with no tokens; batches run on the caller's thread."""
    import threading

    eng = HFEngine(tiny_model(), tokenizer(), SamplingConfig(), shared=True, threads=1, threaded=False)
    seen: list[int] = []
    batch = eng._generate_batch

    def spy(units: object) -> None:
        seen.append(threading.get_ident())
        batch(units)  # type: ignore[arg-type]

    eng._generate_batch = spy  # type: ignore[method-assign]
    p = [1, 2, 3]

    async def go() -> tuple[bool, object, object]:
        await eng.pause(abort=False)
        held = asyncio.ensure_future(eng.generate(GenerateRequest("held", p, SamplingParams(max_new_tokens=5))))
        await asyncio.sleep(0.1)
        waited = not held.done()
        await eng.resume()
        first = await asyncio.wait_for(held, 30)
        dropped = asyncio.ensure_future(eng.generate(GenerateRequest("gone", p, SamplingParams(max_new_tokens=5))))
        await asyncio.sleep(0)  # queued, its batch not yet run
        await eng.abort(["gone"])
        return waited, first, await asyncio.wait_for(dropped, 30)

    try:
        waited, first, gone = run(go())
    finally:
        eng.shutdown()
    assert waited, "a request made while paused must wait for resume"
    assert first.samples[0].finish_reason == "length" and len(first.samples[0].token_ids) == 5  # type: ignore[attr-defined]
    assert gone.samples[0].finish_reason == "abort" and len(gone.samples[0].token_ids) == 0  # type: ignore[attr-defined]
    assert seen == [threading.get_ident()], "the one batch must run on the caller's thread"
    assert not run(eng.health()).ok
