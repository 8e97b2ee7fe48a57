"""The conformance suite of the rollout engine protocol (:mod:`relax_hpc.rollout.engine`): every engine runs it.

An engine's test module imports these tests (``from engine_conformance import *``) and defines a fixture
``harness`` that yields a :class:`Harness`: the engine under test, serving the weights of ``harness.model`` (a
float32 CPU copy that the suite uses as the trainer's view, never changed by the engine), a run dir for weight
snapshots, and the vocabulary size. The engine's EOS must be unreachable (an id outside the vocabulary, or
``ignore_eos`` for a server), so samples end only by length, by ``stop_token_ids`` or by abort.

What every engine must do: ``n`` samples per prompt for concurrent requests with their own settings; abort in the
middle of generation, returning the partial tokens with their versions, and continue them as a prefix; pause (with
and without abort) and resume; receive new weights from a snapshot folder and from a bucket stream; log-probs of the
sampling distribution equal to the trainer's recomputation at the same weights (float32 CPU: max abs diff <= 1e-4).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch

from relax_hpc.rollout.engine import (
    BucketStream,
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    SamplingParams,
    SnapshotFolder,
    generate_all,
)
from relax_hpc.rundir import RunDir

T = TypeVar("T")
TOL = 1e-4

__all__ = [
    "Harness",
    "test_abort_mid_generation_returns_partial_tokens_with_versions",
    "test_bucket_stream_update",
    "test_logprobs_equal_the_trainers_recomputation",
    "test_n_samples_per_prompt",
    "test_pause_abort_and_requests_submitted_while_paused",
    "test_pause_holds_and_resume_continues_with_new_weights",
    "test_per_request_settings",
    "test_samples_own_their_arrays",
    "test_snapshot_folder_update",
]


@dataclass
class Harness:
    engine: RolloutEngine
    model: torch.nn.Module
    """The weights the engine serves at version 0, float32 on the CPU (the trainer's view; the suite's reference)."""
    run_dir: RunDir
    vocab: int
    interrupt_s: float = 0.3
    """How long the suite lets a request run before it interrupts it (abort, pause): long enough for a few tokens
    of the engine under test (a server on a loaded CPU needs more than an in-process loop)."""
    concurrent: bool = True
    """The engine takes calls while a batch runs. False only for an in-process engine without a thread of its own
    (the ``hf`` engine of colocate, whose batches run on the caller's thread): nothing can reach it mid-batch, so
    the three tests of aborts and pauses *during* generation do not apply; the engine's own module tests that it
    acts on them between batches."""


def needs_concurrency(h: Harness) -> None:
    if not h.concurrent:
        import pytest

        pytest.skip("the engine runs its batches on the caller's thread: no call can reach it mid-batch")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def prompts(vocab: int, k: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(1, vocab, size=n)] for n in (3, 6, 2, 5, 4)[:k]]


def recompute(model: torch.nn.Module, prompt: list[int], response: np.ndarray, temperature: float) -> np.ndarray:
    """The trainer's log-probs of ``response`` after ``prompt`` (its batch code and ``sequence_logprobs``)."""
    from relax_hpc.config.load import validate_dict
    from relax_hpc.trainer.batch import TrainItem, build_micro_batch
    from relax_hpc.trainer.torch_trainer import TorchTrainer

    cfg = validate_dict({"data": {"task": {"name": "reverse_digits"}}, "model": {"path": "tiny"},
                         "trainer": {"device": "cpu"}, "rollout": {"sampling": {"temperature": temperature}}})
    trainer = TorchTrainer(cfg, model, device="cpu", dtype=torch.float32, algorithm=None)
    item = TrainItem.of(prompt_ids=np.asarray(prompt), response_ids=np.asarray(response),
                     logprobs=np.zeros(len(response), np.float32), loss_mask=np.ones(len(response)))
    with torch.no_grad():
        lp, _ = trainer.sequence_logprobs(model, build_micro_batch([item], rows=False))
    return lp.numpy()


def perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """New weights for the same architecture (what a training step would publish)."""
    g = torch.Generator().manual_seed(seed)
    return {k: (v + 0.3 * torch.randn(v.shape, generator=g)).contiguous() if v.is_floating_point() else v.clone()
            for k, v in model.state_dict().items()}


def reference(h: Harness, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    m = copy.deepcopy(h.model)
    m.load_state_dict(state)
    return m.eval()


def publish(h: Harness, state: dict[str, torch.Tensor], version: int) -> SnapshotFolder:
    from relax_hpc.weights import SnapshotPublisher

    SnapshotPublisher(h.run_dir, keep_last=10).publish(state, version=version, step=version)
    return SnapshotFolder(h.run_dir.snapshot(version), "sha256")


class Buckets(BucketStream):
    """A state dict in buckets of about ``per`` tensors each."""

    def __init__(self, state: dict[str, torch.Tensor], per: int = 3):
        self.state, self.per = state, per

    def buckets(self) -> Iterator[dict[str, Any]]:
        names = sorted(self.state)
        for k in range(0, len(names), self.per):
            yield {n: self.state[n] for n in names[k:k + self.per]}


def check_logprobs(model: torch.nn.Module, prompt: list[int], tokens: np.ndarray, logprobs: np.ndarray,
                   temperature: float) -> None:
    want = recompute(model, prompt, tokens, temperature)
    diff = float(np.abs(want - logprobs).max()) if len(tokens) else 0.0
    assert diff <= TOL, f"rollout log-probs differ from the trainer's by {diff:.2e}"


def check_greedy(model: torch.nn.Module, prompt: list[int], tokens: np.ndarray) -> None:
    """Every token is the reference's argmax (up to float ties)."""
    ids = torch.tensor([prompt + tokens.tolist()])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
    p = len(prompt)
    chosen = lp[p - 1:-1].gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0]
    best = lp[p - 1:-1].max(-1).values
    assert bool((chosen >= best - TOL).all()), "a greedy token is not the argmax"


async def started(engine: RolloutEngine, request: GenerateRequest, wait_s: float = 0.3) -> asyncio.Task[Any]:
    """``request`` in flight for ``wait_s`` (callers pass their harness's ``interrupt_s``)."""
    task = asyncio.ensure_future(engine.generate(request))
    await asyncio.sleep(wait_s)
    assert not task.done(), "the request finished before it could be interrupted: raise max_new_tokens"
    return task


CUT_TRIES = 3
"""How often :func:`cut_in_flight` sends a fresh request when the interrupt arrived after the request had already
run to its budget (the server's load changed between the calibration and the test)."""


async def cut_in_flight(engine: RolloutEngine, request: GenerateRequest, wait_s: float,
                        cut: Callable[[str], Awaitable[Any]],
                        undo: Callable[[], Awaitable[Any]] | None = None) -> GenerateResult:
    """``request`` interrupted by ``cut(request_id)`` after ``wait_s``. An interrupt that lands after every sample
    ran to ``max_new_tokens`` did not happen mid-generation: ``undo()`` (a pause's resume) and the request is sent
    again under a fresh id, at most ``CUT_TRIES`` times; the test fails if no interrupt ever lands. Returns the
    interrupted result."""
    from dataclasses import replace

    budget = request.sampling.max_new_tokens
    for attempt in range(CUT_TRIES):
        sent = replace(request, request_id=f"{request.request_id}#{attempt}" if attempt else request.request_id)
        task = await started(engine, sent, wait_s)
        await cut(sent.request_id)
        out: GenerateResult = await asyncio.wait_for(task, 60)
        if any(s.finish_reason != "length" or len(s.token_ids) < budget for s in out.samples):
            return out
        if undo is not None:
            await undo()
    raise AssertionError(f"{CUT_TRIES} requests of {budget} tokens all finished before the interrupt reached them: "
                         "raise max_new_tokens or the model's size")


# ---------------------------------------------------------------------------------------------- the tests
def test_n_samples_per_prompt(harness: Harness) -> None:
    h = harness
    ps = prompts(h.vocab)
    reqs = [GenerateRequest(f"n{i}", p, SamplingParams(n=n, temperature=1.0, max_new_tokens=6))
            for i, (p, n) in enumerate(zip(ps, (1, 3, 4)))]
    out: list[GenerateResult] = run(generate_all(h.engine, reqs))
    assert [r.request_id for r in out] == ["n0", "n1", "n2"]
    assert [len(r.samples) for r in out] == [1, 3, 4]
    for r in out:
        for s in r.samples:
            assert s.finish_reason == "length" and len(s.token_ids) == 6
            assert s.token_ids.dtype == np.int32 and s.logprobs.dtype == np.float32
            assert len(s.logprobs) == len(s.versions) == len(s.mask()) == 6
            assert (s.versions == h.engine.version).all() and (s.mask() == 1).all()
            assert ((s.token_ids >= 0) & (s.token_ids < h.vocab)).all() and (s.logprobs <= 0).all()
    assert len({tuple(s.token_ids) for s in out[2].samples}) > 1, "n samples of one prompt should differ"


def test_samples_own_their_arrays(harness: Harness) -> None:
    """The driver adopts a sample's arrays without copying them and appends to them (partial rollouts, environment
    tokens): no two samples may share memory, and writing into one sample changes no other."""
    h = harness
    ps = prompts(h.vocab)
    reqs = [GenerateRequest(f"own{i}", p, SamplingParams(n=3, temperature=1.0, max_new_tokens=5))
            for i, p in enumerate(ps[:2])]
    samples = [s for r in run(generate_all(h.engine, reqs)) for s in r.samples]
    fields = ("token_ids", "logprobs", "versions")
    before = [[getattr(s, f).copy() for f in fields] + [s.mask().copy()] for s in samples]
    for a, sa in enumerate(samples):
        for sb in samples[a + 1:]:
            for f in fields:
                assert not np.shares_memory(getattr(sa, f), getattr(sb, f)), f"two samples share their {f}"
            assert not np.shares_memory(sa.mask(), sb.mask()), "two samples share their loss mask"
    first = samples[0]
    first.token_ids[:] = -7
    first.versions[:] = -7
    first.mask()[:] = 0
    for s, old in zip(samples[1:], before[1:]):
        now = [getattr(s, f) for f in fields] + [s.mask()]
        assert all(np.array_equal(x, y) for x, y in zip(now, old)), "writing one sample changed another"
        assert (s.versions == h.engine.version).all() and (s.mask() == 1).all()


def test_per_request_settings(harness: Harness) -> None:
    h = harness
    p0, p1, _ = prompts(h.vocab)

    async def go() -> list[GenerateResult]:
        greedy = GenerateRequest("greedy", p0, SamplingParams(n=3, temperature=0.0, max_new_tokens=5))
        short = GenerateRequest("short", p1, SamplingParams(n=2, temperature=1.0, max_new_tokens=2))
        seeded = [GenerateRequest(f"seeded{k}", p1, SamplingParams(n=2, temperature=1.0, top_k=4, max_new_tokens=6,
                                                                   seed=1234)) for k in range(2)]
        return await generate_all(h.engine, [greedy, short, *seeded])

    greedy, short, s1, s2 = run(go())
    assert len({tuple(s.token_ids) for s in greedy.samples}) == 1, "greedy samples must agree"
    check_greedy(h.model, p0, greedy.samples[0].token_ids)
    assert all(len(s.token_ids) == 2 for s in short.samples)
    assert [s.token_ids.tolist() for s in s1.samples] == [s.token_ids.tolist() for s in s2.samples], (
        "the same request seed must give the same samples")
    # a stop token ends the sample on it (kept); the greedy continuation is known, so the stop is deterministic
    stop_at = int(greedy.samples[0].token_ids[2])
    first = greedy.samples[0].token_ids.tolist().index(stop_at)
    out = run(h.engine.generate(GenerateRequest("stop", p0, SamplingParams(temperature=0.0, max_new_tokens=5,
                                                                            stop_token_ids=(stop_at,)))))
    s = out.samples[0]
    assert s.finish_reason == "stop" and s.token_ids.tolist() == greedy.samples[0].token_ids[:first + 1].tolist()


def test_abort_mid_generation_returns_partial_tokens_with_versions(harness: Harness) -> None:
    h = harness
    needs_concurrency(h)
    p = prompts(h.vocab)[1]
    budget = 1500
    sampling = SamplingParams(n=2, temperature=0.9, max_new_tokens=budget)

    aborted, rest, other = run(abort_and_continue(h, p, sampling))
    assert other.samples[0].finish_reason == "length", "abort must end only the named request"
    for a, r in zip(aborted.samples, rest.samples):
        assert a.finish_reason == "abort" and 0 < len(a.token_ids) < budget
        assert len(a.versions) == len(a.token_ids) and (a.versions == h.engine.version).all()
        check_logprobs(h.model, p, a.token_ids, a.logprobs, 0.9)
        more = max(len(x.token_ids) for x in aborted.samples) + 20
        assert r.finish_reason == "length" and len(a.token_ids) + len(r.token_ids) == more  # only new tokens
        assert (r.versions == h.engine.version).all()
        joined = np.concatenate([a.token_ids, r.token_ids])
        check_logprobs(h.model, p, joined, np.concatenate([a.logprobs, r.logprobs]), 0.9)


async def abort_and_continue(h: Harness, p: list[int], sampling: SamplingParams
                             ) -> tuple[GenerateResult, GenerateResult, GenerateResult]:
    """A request ``long`` aborted by id mid-generation (:func:`cut_in_flight`) while a short request runs beside it,
    then its samples continued as prefixes with a budget 20 tokens past the longer one (the prefix counts against
    it). Returns (the aborted result, the continuation, the short request's result)."""
    others: list[asyncio.Future[GenerateResult]] = []

    async def cut(rid: str) -> None:  # abort must end only the named request
        others.append(asyncio.ensure_future(h.engine.generate(GenerateRequest(f"other/{rid}", p,
                                                                              replace_n(sampling, 1, 4)))))
        await h.engine.abort([rid])

    aborted = await cut_in_flight(h.engine, GenerateRequest("long", p, sampling), h.interrupt_s, cut)
    more = max(len(s.token_ids) for s in aborted.samples) + 20
    rest = await h.engine.generate(GenerateRequest("long/2", p, replace_n(sampling, 2, more), prefixes=[
        _prefix(s) for s in aborted.samples]))
    await asyncio.gather(*others)
    return aborted, rest, others[-1].result()

def replace_n(s: SamplingParams, n: int, max_new_tokens: int) -> SamplingParams:
    from dataclasses import replace

    return replace(s, n=n, max_new_tokens=max_new_tokens)


def _prefix(s: Any) -> Any:
    from relax_hpc.rollout.engine import Prefix

    return Prefix(token_ids=s.token_ids, logprobs=s.logprobs, versions=s.versions, loss_mask=s.mask())


def test_pause_holds_and_resume_continues_with_new_weights(harness: Harness) -> None:
    h = harness
    needs_concurrency(h)
    p = prompts(h.vocab)[0]
    new = perturbed(h.model, 1)
    v0 = h.engine.version
    folder = publish(h, new, v0 + 1)

    held = 600  # 4x the tokens a harness's interrupt_s lets through: still running at the pause, then all decoded

    async def go() -> GenerateResult:
        task = await started(h.engine, GenerateRequest("held", p, SamplingParams(n=1, temperature=0.0,
                                                                                  max_new_tokens=held)), h.interrupt_s)
        await h.engine.pause(abort=False)
        await asyncio.sleep(0.2)
        assert not task.done(), "pause(abort=False) must hold the request"
        await h.engine.receive(v0 + 1, folder)
        await h.engine.resume()
        return await asyncio.wait_for(task, 300)  # a bound, not a speed check: a server on a loaded CPU is slow

    s = run(go()).samples[0]
    assert s.finish_reason == "length" and len(s.token_ids) == held
    assert s.versions[0] == v0 and s.versions[-1] == v0 + 1 and (np.diff(s.versions) >= 0).all()
    old = int((s.versions == v0).sum())
    check_greedy(h.model, p, s.token_ids[:old])  # the tokens before the update are the old weights' argmax
    assert (run(h.engine.health())).version == v0 + 1


def test_pause_abort_and_requests_submitted_while_paused(harness: Harness) -> None:
    h = harness
    needs_concurrency(h)
    p = prompts(h.vocab)[2]

    async def go() -> tuple[GenerateResult, asyncio.Task[Any], bool]:
        async def cut(_: str) -> None:
            await h.engine.pause(abort=True)

        aborted = await cut_in_flight(h.engine, GenerateRequest("a", p, SamplingParams(n=2, max_new_tokens=1500)),
                                      h.interrupt_s, cut, undo=h.engine.resume)
        later = asyncio.ensure_future(h.engine.generate(GenerateRequest("b", p, SamplingParams(max_new_tokens=4))))
        await asyncio.sleep(0.3)
        waited = not later.done()
        await h.engine.resume()
        await asyncio.wait_for(later, 30)
        return aborted, later, waited

    aborted, later, waited = run(go())
    assert all(s.finish_reason == "abort" and len(s.token_ids) < 1500 for s in aborted.samples)
    assert waited, "a request submitted while paused must wait for resume"
    assert later.result().samples[0].finish_reason == "length"
    assert run(h.engine.health()).ok


def test_snapshot_folder_update(harness: Harness) -> None:
    h = harness
    new = perturbed(h.model, 2)
    v = h.engine.version + 5
    run(h.engine.receive(v, publish(h, new, v)))
    check_served(h, reference(h, new), v)


def test_bucket_stream_update(harness: Harness) -> None:
    h = harness
    new = perturbed(h.model, 3)
    v = h.engine.version + 2
    run(h.engine.receive(v, Buckets(new)))
    check_served(h, reference(h, new), v)


def check_served(h: Harness, model: torch.nn.Module, version: int) -> None:
    """The engine serves ``model`` at ``version``: greedy tokens and log-probs as the reference computes them."""
    p = prompts(h.vocab)[1]
    s = run(h.engine.generate(GenerateRequest("w", p, SamplingParams(temperature=0.0, max_new_tokens=8)))).samples[0]
    assert run(h.engine.health()).version == version and (s.versions == version).all()
    check_greedy(model, p, s.token_ids)
    check_logprobs(model, p, s.token_ids, s.logprobs, 1.0)


def test_logprobs_equal_the_trainers_recomputation(harness: Harness) -> None:
    h = harness
    ps = prompts(h.vocab, 5)
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.7, 5, 1.0), (1.2, 0, 0.8)):
        sp = SamplingParams(n=3, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12)
        out = run(generate_all(h.engine, [GenerateRequest(f"lp{i}", p, sp) for i, p in enumerate(ps)]))
        for p, r in zip(ps, out):
            for s in r.samples:
                check_logprobs(h.model, p, s.token_ids, s.logprobs, temperature)
