"""Partial rollout: samples cut by a weight update are resubmitted with the tokens generated so far.

:func:`generate_resumable` calls the engine, and while some samples came back ``abort`` because the engine was
paused for a weight update (``engine.was_preempted``), resubmits exactly those with a :class:`Prefix` holding their
tokens, log-probs and per-token versions; the engine generates after prompt + prefix and the new tokens are joined
on, each keeping the version that produced it (a sample's staleness is its oldest token's version). A sample cut
more than ``max_resubmits`` times is returned as ``abort``. Samples aborted by :meth:`RolloutEngine.abort` are not
resubmitted. :func:`update_weights` takes a weight update the way ``rollout.server.partial_rollout`` says.
"""

from __future__ import annotations

import numpy as np

from relax_hpc.rollout.engine import (
    GenerateRequest,
    GenerateResult,
    Prefix,
    RolloutEngine,
    SampleOutput,
    WeightSource,
)


def join(prefix: Prefix | None, new: SampleOutput) -> SampleOutput:
    """A sample's tokens so far followed by the tokens of the latest call."""
    if prefix is None:
        return new
    return SampleOutput(
        token_ids=np.concatenate([prefix.token_ids, new.token_ids]).astype(np.int32),
        logprobs=np.concatenate([prefix.logprobs, new.logprobs]).astype(np.float32),
        versions=np.concatenate([prefix.versions, new.versions]).astype(np.int32),
        finish_reason=new.finish_reason,
        loss_mask=np.concatenate([prefix.loss_mask, new.mask()]).astype(np.uint8),
        timings={k: new.timings.get(k, 0.0) for k in new.timings},
    )


def as_prefix(sample: SampleOutput) -> Prefix:
    return Prefix(token_ids=sample.token_ids, logprobs=sample.logprobs, versions=sample.versions,
                  loss_mask=sample.mask())


async def generate_resumable(engine: RolloutEngine, request: GenerateRequest, *, max_resubmits: int
                             ) -> tuple[GenerateResult, int]:
    """Generate ``request`` to the end across weight updates: (result, resubmissions made)."""
    prefixes: list[Prefix | None] = list(request.prefixes) if request.prefixes else [None] * request.sampling.n
    joined: list[SampleOutput | None] = [None] * request.sampling.n
    todo = list(range(request.sampling.n))
    resubmits = 0
    preempted = getattr(engine, "was_preempted", lambda _rid: False)
    forget = getattr(engine, "forget", lambda _rid: None)
    while True:
        sub = GenerateRequest(request_id=f"{request.request_id}~{resubmits}" if resubmits else request.request_id,
                              prompt_ids=request.prompt_ids, sampling=_one_each(request, len(todo)),
                              multimodal=request.multimodal, media=request.media,
                              engine_prompt_ids=request.engine_prompt_ids,
                              prefixes=[prefixes[j] for j in todo] if any(prefixes[j] for j in todo) else None)
        result = await engine.generate(sub)
        cut = preempted(sub.request_id)
        forget(sub.request_id)
        again = []
        for j, sample in zip(todo, result.samples, strict=True):
            joined[j] = join(prefixes[j], sample)
            if sample.finish_reason == "abort" and cut:
                prefixes[j] = as_prefix(joined[j])  # type: ignore[arg-type]
                again.append(j)
        if not again or resubmits >= max_resubmits:
            break
        todo = again
        resubmits += 1
    return GenerateResult(request_id=request.request_id, samples=[s for s in joined if s is not None]), resubmits


def _one_each(request: GenerateRequest, n: int):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(request.sampling, n=n)


async def update_weights(engine: RolloutEngine, version: int, source: WeightSource, *, partial_rollout: bool,
                         drain_timeout_s: float = 600.0) -> None:
    """Take one weight update: ``partial_rollout`` -> pause with abort (the cut samples get resubmitted by
    :func:`generate_resumable`), receive, resume; else stop starting requests, wait for those in flight, receive,
    resume."""
    if partial_rollout:
        await engine.pause(abort=True)
    else:
        drain = getattr(engine, "drain", None)
        if drain is None:
            await engine.pause(abort=False)
        else:
            await drain(drain_timeout_s)
    try:
        await engine.receive(version, source)
    finally:
        await engine.resume()
