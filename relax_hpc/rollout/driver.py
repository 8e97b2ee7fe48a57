"""The rollout driver: prompts -> engine requests -> rewards -> groups -> the sample store. The one path colocate,
the fully_async workers and the benchmarks generate through.

The per-prompt path is a coroutine, :meth:`Episode.run_group`, and the per-sample path another,
:meth:`Episode.run_sample`; either may call the engine any number of times. The default episode makes one request
with ``n`` samples (they share the prompt's prefill) and continues each sample that came back aborted (the engine
was paused for new weights) from where it stopped, as a prefix: a partial rollout. A multi-turn environment
subclasses :class:`Episode` and overrides ``run_sample``: append the environment's tokens with
:meth:`Trajectory.append_context` (loss mask 0) and continue with :meth:`EpisodeContext.continue_sample`.

A :class:`Trajectory` carries, per response token, its id, the rollout log-prob, the weight version that produced it
and the loss mask. A sample's version (the one its staleness is measured by) is its oldest generated token's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np

from relax_hpc.models.load import decode_texts
from relax_hpc.rollout.engine import GenerateRequest, Prefix, RolloutEngine, SampleOutput, SamplingParams
from relax_hpc.timing import PhaseTimer

T = TypeVar("T")
_INT32, _FLOAT32, _UINT8 = np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.uint8)


def _typed(a: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """``a`` as ``dtype`` without a copy when it already is (the common case: no conversion call per sample)."""
    return a if a.dtype is dtype else a.astype(dtype, copy=False)


@dataclass
class Trajectory:
    """One sample's response, built from one or more engine calls (and environment tokens, in multi-turn)."""

    token_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    versions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    """Weight version per token; -1 on tokens the engine did not generate."""
    loss_mask: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))
    finish_reason: str = "length"
    timings: dict[str, float] = field(default_factory=dict)
    engine_calls: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    """JSON-able extras stored with the sample (an environment's turn count, tool results ...)."""
    prompt_ids: np.ndarray | None = None
    """This sample's own prompt tokens (a multi-turn episode renders its prompt with the tool section, and a
    template that is not prefix-preserving starts samples from a later point); None = the prompt's."""
    turns: np.ndarray | None = None
    """[T, 2] int32 (start, end) of each generated turn in the response (multi-turn episodes; stored in the
    sample store's ``turns`` column)."""

    @classmethod
    def from_output(cls, out: SampleOutput) -> Trajectory:
        """The trajectory of one engine call (its arrays are adopted, not copied)."""
        return cls(token_ids=_typed(out.token_ids, _INT32), logprobs=_typed(out.logprobs, _FLOAT32),
                   versions=_typed(out.versions, _INT32), loss_mask=_typed(out.mask(), _UINT8),
                   finish_reason=out.finish_reason, timings=dict(out.timings), engine_calls=1)

    def extend(self, out: SampleOutput) -> Trajectory:
        """Append the tokens of one engine call (each keeps its version)."""
        self.token_ids = np.concatenate([self.token_ids, out.token_ids.astype(np.int32)])
        self.logprobs = np.concatenate([self.logprobs, out.logprobs.astype(np.float32)])
        self.versions = np.concatenate([self.versions, out.versions.astype(np.int32)])
        self.loss_mask = np.concatenate([self.loss_mask, out.mask().astype(np.uint8)])
        self.finish_reason = out.finish_reason
        for k, v in out.timings.items():
            self.timings[k] = self.timings.get(k, 0.0) + v
        self.engine_calls += 1
        return self

    def append_context(self, token_ids: Sequence[int]) -> Trajectory:
        """Append tokens that came from elsewhere (tool output, the environment): not trained on, no version."""
        k = len(token_ids)
        self.token_ids = np.concatenate([self.token_ids, np.asarray(token_ids, dtype=np.int32)])
        self.logprobs = np.concatenate([self.logprobs, np.zeros(k, np.float32)])
        self.versions = np.concatenate([self.versions, np.full(k, -1, np.int32)])
        self.loss_mask = np.concatenate([self.loss_mask, np.zeros(k, np.uint8)])
        return self

    def as_prefix(self) -> Prefix:
        return Prefix(token_ids=self.token_ids, logprobs=self.logprobs, versions=self.versions,
                      loss_mask=self.loss_mask)

    def version_range(self, default: int) -> tuple[int, int]:
        """(oldest, newest) version of the generated tokens; ``(default, default)`` if there are none."""
        v = self.versions
        if not len(v):
            return default, default
        lo = int(v.min())
        if lo < 0:  # context tokens (no version) among them
            v = v[v >= 0]
            if not len(v):
                return default, default
            lo = int(v.min())
        return lo, int(v.max())


@dataclass
class EpisodeContext:
    """What an episode may use: the engine, the sampling settings, the request ids of its prompt."""

    engine: RolloutEngine
    sampling: SamplingParams
    request_id: str
    resume_aborted: bool = True
    """Continue samples that came back aborted (after the engine resumes, with its new weights)."""
    stopping: bool = False
    """Set by the driver's owner when the role is stopping: do not continue aborted samples."""
    _calls: int = 0

    def next_id(self) -> str:
        self._calls += 1
        return f"{self.request_id}/{self._calls}"

    def request(self, prompt: Any, *, n: int, prefixes: list[Prefix] | None = None) -> GenerateRequest:
        sampling = self.sampling if n == self.sampling.n else replace(self.sampling, n=n)
        return GenerateRequest(self.next_id(), prompt.prompt_ids, sampling,
                               multimodal=getattr(prompt, "multimodal", None), prefixes=prefixes,
                               media=getattr(prompt, "media", None),  # raw media, for server engines
                               engine_prompt_ids=getattr(prompt, "engine_prompt_ids", None))

    async def continue_sample(self, prompt: Any, traj: Trajectory, *, new_tokens: int | None = None) -> SampleOutput:
        """One more engine call for ``traj``: generate after the prompt and everything ``traj`` holds. The budget is
        ``sampling.max_new_tokens`` for the whole response (``traj`` counts against it), or ``new_tokens`` more."""
        req = self.request(prompt, n=1, prefixes=[traj.as_prefix()])
        if new_tokens is not None:
            req.sampling = replace(req.sampling, max_new_tokens=len(traj.token_ids) + new_tokens)
        res = await self.engine.generate(req)
        return res.samples[0]


class Episode:
    """How one prompt becomes its group of samples (see the module docstring). Subclass for environments."""

    async def run_group(self, ctx: EpisodeContext, prompt: Any) -> list[Trajectory]:
        res = await ctx.engine.generate(ctx.request(prompt, n=ctx.sampling.n))
        firsts = [Trajectory.from_output(s) for s in res.samples]
        if type(self).run_sample is Episode.run_sample and all(t.finish_reason != "abort" for t in firsts):
            return firsts  # nothing to continue: no task per sample (a demo step has 128 of them)
        return list(await asyncio.gather(*(self.run_sample(ctx, prompt, t, j) for j, t in enumerate(firsts))))

    async def run_sample(self, ctx: EpisodeContext, prompt: Any, traj: Trajectory, index: int) -> Trajectory:
        """Finish sample ``index`` after its first engine call. Default: continue it while it comes back aborted."""
        while traj.finish_reason == "abort" and ctx.resume_aborted and not ctx.stopping:
            traj.extend(await ctx.continue_sample(prompt, traj))
        return traj


@dataclass
class BatchResult:
    """One batch of prompts through the driver."""

    groups: list[Any]
    """The store groups written (``SampleGroup``)."""
    trajectories: list[list[Trajectory]]
    counts: dict[str, float]
    reward_errors: int
    samples: int


class RolloutDriver:
    """Runs prompts through an engine, scores them, writes their groups to the store.

    ``writer``: a ``ShardWriter`` (None: groups are built but not written). ``admission``: a fully_async worker's
    claim (:class:`~relax_hpc.rollout.admission.Admission`), released once the batch's shard is published.
    Synchronous callers use :meth:`run_batch` and :meth:`call`: the driver owns one event loop for them.
    """

    PHASES = ("generate", "reward", "store_write")

    def __init__(self, engine: RolloutEngine, tokenizer: Any, rewards: Any, *, sampling: SamplingParams,
                 writer_id: str, writer: Any = None, admission: Any = None, episode: Episode | None = None,
                 resume_aborted: bool = True):
        self.engine = engine
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.sampling = sampling
        self.writer_id = writer_id
        self.writer = writer
        self.admission = admission
        self.episode = episode or Episode()
        self.resume_aborted = resume_aborted
        self.counter = 0
        """Prompts taken so far (group ids are ``<writer_id>:<counter>``)."""
        self.stopping = False
        self._loop = asyncio.new_event_loop()
        self._contexts: list[EpisodeContext] = []

    # ------------------------------------------------------------------------------------------ async parts
    async def rollout(self, prompts: Sequence[Any]) -> list[list[Trajectory]]:
        """Every prompt's group of trajectories, all prompts concurrently (the engine batches them)."""
        ctxs = [EpisodeContext(self.engine, self.sampling, f"{self.writer_id}:{self.counter + i}",
                               resume_aborted=self.resume_aborted, stopping=self.stopping)
                for i in range(len(prompts))]
        self._contexts = ctxs
        self.counter += len(prompts)
        try:
            return list(await asyncio.gather(*(self.episode.run_group(c, p) for c, p in zip(ctxs, prompts))))
        finally:
            self._contexts = []

    def stop(self) -> None:
        """The role is stopping: episodes in flight continue no aborted sample."""
        self.stopping = True
        for c in self._contexts:
            c.stopping = True

    # ------------------------------------------------------------------------------------------ sync parts
    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run one coroutine (``engine.receive(...)``, ``driver.rollout(...)``) on the driver's loop."""
        return self._loop.run_until_complete(coro)

    def run_batch(self, prompts: Sequence[Any], timer: PhaseTimer | None = None) -> BatchResult:
        """Generate, score, build and write the groups of ``prompts``; phases ``generate``, ``reward`` and
        ``store_write`` go to ``timer``."""
        timer = timer or PhaseTimer()
        first = self.counter
        with timer.phase("generate"):
            trajs = self.call(self.rollout(prompts))
        with timer.phase("reward"):
            scored = self.score(prompts, trajs)
        groups, counts = build_groups(prompts, trajs, scored, writer_id=self.writer_id, counter=first,
                                      default_version=self.engine.version)
        take = getattr(self.episode, "take_metrics", None)
        if take is not None:
            counts.update(take())
        reported = getattr(self.rewards, "metrics", None)
        if reported is not None:
            counts.update(reported())  # a GenRM judge's genrm/* counters
        with timer.phase("store_write"):
            if groups and self.writer is not None:
                self.writer.write(groups)
            if self.admission is not None:
                self.admission.release()  # after the shard is published: its groups now count in the backlog
        return BatchResult(groups, trajs, counts, int(getattr(scored, "num_errors", 0)),
                           sum(len(g) for g in trajs))

    def score(self, prompts: Sequence[Any], trajs: list[list[Trajectory]]) -> Any:
        """Decode every response and score it: a ``RewardResult`` over the flat list, prompt by prompt. An episode
        that scores its own samples (multi-turn environments: ``episode.score``) does it instead."""
        own = getattr(self.episode, "score", None)
        if own is not None:
            return own(prompts, trajs)
        texts = decode_texts(self.tokenizer, [t.token_ids for g in trajs for t in g])
        answers = [p.answer for p, g in zip(prompts, trajs) for _ in g]
        metas = [p.meta for p, g in zip(prompts, trajs) for _ in g]
        if getattr(self.rewards, "on_loop", False):  # a reward on the rollout's engine: on the engine's loop
            return self.call(self.rewards.score_async(texts, answers, metas))
        return self.rewards.score(texts, answers, metas)

    def close(self) -> None:
        """Close the engine and the loop."""
        with contextlib.suppress(Exception):
            self.call(self.engine.close())
        self._loop.close()


def version_spans(trajs: Sequence[Trajectory], default: int) -> tuple[list[int], list[int]]:
    """:meth:`Trajectory.version_range` of every trajectory at once: (oldest, newest) lists, over one concatenation
    of the versions and two segment reductions instead of two reductions per sample."""
    n = len(trajs)
    lengths = np.fromiter((len(t.versions) for t in trajs), dtype=np.int64, count=n)
    first, last = [default] * n, [default] * n
    filled = np.flatnonzero(lengths)
    if not len(filled):
        return first, last
    flat = np.concatenate([trajs[i].versions for i in filled.tolist()]).astype(np.int64, copy=False)
    starts = np.zeros(len(filled), dtype=np.int64)
    np.cumsum(lengths[filled][:-1], out=starts[1:])
    generated = flat >= 0  # context tokens (-1) have no version
    lo = np.minimum.reduceat(np.where(generated, flat, np.iinfo(np.int64).max), starts)
    hi = np.maximum.reduceat(np.where(generated, flat, -1), starts)
    for i, a, b in zip(filled.tolist(), lo.tolist(), hi.tolist()):
        if b >= 0:  # else only context tokens: the default
            first[i], last[i] = a, b
    return first, last


def build_groups(prompts: Sequence[Any], trajs: list[list[Trajectory]], result: Any, *, writer_id: str, counter: int,
                 default_version: int) -> tuple[list[Any], dict[str, float]]:
    """Store groups for scored trajectories. A group with a sample whose reward failed under ``on_error=drop`` is
    dropped whole (counted). A sample's ``version`` is its oldest generated token's. Returns (groups, counts)."""
    from relax_hpc.store.sample import Sample, SampleGroup

    groups: list[Any] = []
    dropped = 0
    k = 0
    rewards = np.asarray(result.rewards, dtype=np.float32)
    drop = np.asarray(getattr(result, "dropped", np.zeros(len(rewards), dtype=bool)))
    extras = {name: np.asarray(v).tolist() for name, v in getattr(result, "extras", {}).items()}
    firsts, lasts = version_spans([t for group in trajs for t in group], default_version)
    reward_list = rewards.tolist()  # Python floats, as float(rewards[j]) gives
    for i, (prompt, group) in enumerate(zip(prompts, trajs)):
        idx = range(k, k + len(group))
        k += len(group)
        if drop[idx.start:idx.stop].any():
            dropped += 1
            continue
        samples = []
        prompt_ids = np.asarray(prompt.prompt_ids, dtype=np.int32)  # once per group; the store only reads it
        prompt_meta = {"prompt": prompt.meta} if prompt.meta else {}
        for j, t in zip(idx, group):
            own_prompt = prompt_ids if t.prompt_ids is None else np.asarray(t.prompt_ids, dtype=np.int32)
            samples.append(Sample(
                prompt_ids=own_prompt, response_ids=t.token_ids,
                logprobs=t.logprobs, loss_mask=t.loss_mask, reward=reward_list[j], version=firsts[j],
                version_first=firsts[j], version_last=lasts[j], rewards={n: float(v[j]) for n, v in extras.items()},
                timings=dict(t.timings), tensors=dict(prompt.multimodal or {}), turns=t.turns,
                metadata={"finish_reason": t.finish_reason, **t.metadata, **prompt_meta},
            ))
        groups.append(SampleGroup(group_id=f"{writer_id}:{counter + i}", samples=samples))
    return groups, {"rollout/groups_dropped_reward_error": float(dropped)}
