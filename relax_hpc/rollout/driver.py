"""The rollout driver: prompts -> engine requests -> rewards -> groups -> the sample store. The one path colocate,
the fully_async workers and the benchmarks generate through.

The per-prompt path is a coroutine, :meth:`Episode.run_group`, and the per-sample path another,
:meth:`Episode.run_sample`; either may call the engine any number of times. The default episode makes one request
with ``n`` samples (they share the prompt's prefill) and continues each sample that came back aborted (the engine
was paused for new weights) from where it stopped, as a prefix: a partial rollout. That abort-and-resubmit loop is
:meth:`EpisodeContext.finish`, the only one (multi-turn episodes use it for every turn). A multi-turn environment
subclasses :class:`Episode`: append the environment's tokens with :meth:`Sample.append_context` (loss mask 0) and
continue with :meth:`EpisodeContext.continue_sample`, or build its samples itself and score them
(:meth:`Episode.score`).

Every sample is the record :class:`relax_hpc.record.Sample` from its first engine call on: per response token its
id, the rollout log-prob, the weight version that produced it and the loss mask. A sample's version (the one its
staleness is measured by) is its oldest generated token's. The driver sets its reward, versions and group, and the
store writes it as it is (``docs/sample-path.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from relax_hpc.models.load import decode_texts
from relax_hpc.record import Sample, SampleGroup
from relax_hpc.rollout.engine import GenerateRequest, Prefix, RolloutEngine, SampleOutput, SamplingParams
from relax_hpc.timing import PhaseTimer

if TYPE_CHECKING:
    from relax_hpc.data.dataset import Prompt
    from relax_hpc.rollout.scoring import RewardResult, RewardScorer

T = TypeVar("T")

MAX_RESUBMITS = 16
"""A sample (or a multi-turn episode's turn) aborted this many times (weight updates) is kept as it is."""


def derive_seed(base: int | None, request_id: str, index: int) -> int:
    """The seed of sample ``index`` of a request: ``base + index`` when the sampling settings fix a seed, else one
    derived from the request id (the same in every process: not Python's salted ``hash``). An environment's
    ``reset`` gets it."""
    start = base if base is not None else zlib.crc32(request_id.encode()) & 0x7FFF_FFFF
    return start + index


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
    _calls: dict[str, int] = field(default_factory=dict)

    def next_id(self, tag: str = "") -> str:
        """A new request id: ``<request_id>/<n>``, or ``<request_id>/<tag>/<n>`` (a multi-turn episode names its
        turns ``e<episode>.t<turn>``); ``n`` counts the calls of each tag from 1 (resubmits of an abort)."""
        n = self._calls[tag] = self._calls.get(tag, 0) + 1
        return f"{self.request_id}/{tag}/{n}" if tag else f"{self.request_id}/{n}"

    def seed(self, index: int) -> int:
        """The seed of sample ``index`` of this prompt (:func:`derive_seed`)."""
        return derive_seed(self.sampling.seed, self.request_id, index)

    def resuming(self) -> bool:
        """Whether an aborted sample is continued (not when the role is stopping)."""
        return self.resume_aborted and not self.stopping

    def request(self, prompt: Prompt, *, n: int, prefixes: list[Prefix] | None = None,
                sampling: SamplingParams | None = None, tag: str = "") -> GenerateRequest:
        sampling = sampling or self.sampling
        sampling = sampling if n == sampling.n else replace(sampling, n=n)
        return GenerateRequest(self.next_id(tag), prompt.prompt_ids, sampling, multimodal=prompt.multimodal,
                               prefixes=prefixes, media=prompt.media,  # raw media, for server engines
                               engine_prompt_ids=prompt.engine_prompt_ids)

    async def continue_sample(self, prompt: Prompt, sample: Sample, *, new_tokens: int | None = None,
                              sampling: SamplingParams | None = None, tag: str = "") -> SampleOutput:
        """One more engine call for ``sample``: generate after the prompt and everything ``sample`` holds. The budget
        is ``max_new_tokens`` of ``sampling`` (default: the context's) for the whole response (``sample`` counts
        against it), or ``new_tokens`` more."""
        prefix = Prefix(token_ids=sample.response_ids, logprobs=sample.logprobs, versions=sample.token_versions(),
                        loss_mask=sample.mask())  # the response so far
        req = self.request(prompt, n=1, prefixes=[prefix], sampling=sampling, tag=tag)
        if new_tokens is not None:
            req.sampling = replace(req.sampling, max_new_tokens=len(sample.response_ids) + new_tokens)
        res = await self.engine.generate(req)
        return res.samples[0]

    async def generate(self, prompt: Prompt, sampling: SamplingParams | None = None, *, tag: str = "") -> Sample:
        """One sample of ``prompt`` (``sampling`` default: the context's, with ``n=1``), continued while it comes back
        aborted (:meth:`finish`); ``tag`` goes into its request ids."""
        res = await self.engine.generate(self.request(prompt, n=1, sampling=sampling, tag=tag))
        return await self.finish(prompt, Sample.from_output(res.samples[0]), sampling=sampling, tag=tag)

    async def finish(self, prompt: Prompt, sample: Sample, *, sampling: SamplingParams | None = None,
                     tag: str = "") -> Sample:
        """The abort-and-resubmit loop: continue ``sample`` while it comes back aborted (a weight update), at most
        :data:`MAX_RESUBMITS` times, unless the role is stopping. Each token keeps its version."""
        for _ in range(MAX_RESUBMITS):
            if sample.finish_reason != "abort" or not self.resuming():
                break
            sample.extend(await self.continue_sample(prompt, sample, sampling=sampling, tag=tag))
        return sample


class Episode:
    """How one prompt becomes its group of samples (see the module docstring). Subclass for environments.

    What the driver asks of an episode beyond generating: :meth:`score` (its own rewards, or None to have the
    driver's reward score the decoded responses) and :meth:`take_metrics` (its metrics of the batch)."""

    async def run_group(self, ctx: EpisodeContext, prompt: Prompt) -> list[Sample]:
        res = await ctx.engine.generate(ctx.request(prompt, n=ctx.sampling.n))
        prompt_ids = np.asarray(prompt.prompt_ids, dtype=np.int32)  # once per group; the store only reads it
        firsts = [Sample.from_output(s, prompt_ids) for s in res.samples]
        if type(self).run_sample is Episode.run_sample and all(t.finish_reason != "abort" for t in firsts):
            return firsts  # nothing to continue: no task per sample (a demo step has 128 of them)
        return list(await asyncio.gather(*(self.run_sample(ctx, prompt, t, j) for j, t in enumerate(firsts))))

    async def run_sample(self, ctx: EpisodeContext, prompt: Prompt, sample: Sample, index: int) -> Sample:
        """Finish sample ``index`` after its first engine call. Default: continue it while it comes back aborted."""
        return await ctx.finish(prompt, sample)

    def score(self, prompts: Sequence[Prompt], groups: list[list[Sample]]) -> RewardResult | None:
        """The rewards of a batch's samples when the episode sets them itself (a multi-turn environment's reward is
        the episode's; each sample's ``reward`` is already set). None (the default): the driver scores the decoded
        responses with its reward."""
        return None

    def take_metrics(self) -> dict[str, float]:
        """The episode's metrics of the batches since the last call (``agent/*``); none by default."""
        return {}


@dataclass
class PendingBatch:
    """A batch started on the driver's loop (:meth:`RolloutDriver.start_batch`), not written yet."""

    prompts: list[Prompt]
    first: int
    """The driver's prompt counter at its start (its group ids follow)."""
    task: asyncio.Task[list[list[Sample]]]
    claimed: int | None = None
    """Groups of the admission claim it holds (None: the whole claim is released when it is written)."""


@dataclass
class BatchResult:
    """One batch of prompts through the driver."""

    groups: list[SampleGroup]
    """The store groups written."""
    generated: list[list[Sample]]
    """Every prompt's samples as generated (those of dropped groups too)."""
    counts: dict[str, float]
    reward_errors: int
    samples: int


class RolloutDriver:
    """Runs prompts through an engine, scores them, writes their groups to the store.

    ``rewards``: the reward that scores decoded responses (None when the episode scores its own samples).
    ``writer``: a ``ShardWriter`` (None: groups are built but not written). ``admission``: a fully_async worker's
    claim (:class:`~relax_hpc.rollout.admission.Admission`), released once the batch's shard is published.
    Synchronous callers use :meth:`run_batch` and :meth:`call`: the driver owns one event loop for them.
    """

    PHASES = ("generate", "reward", "store_write")

    def __init__(self, engine: RolloutEngine, tokenizer: Any, rewards: RewardScorer | None, *,
                 sampling: SamplingParams, writer_id: str, writer: Any = None, admission: Any = None,
                 episode: Episode | None = None, resume_aborted: bool = True):
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
    async def rollout(self, prompts: Sequence[Prompt]) -> list[list[Sample]]:
        """Every prompt's group of samples, all prompts concurrently (the engine batches them)."""
        return await self._rollout(prompts, self._take_contexts(prompts))

    def _take_contexts(self, prompts: Sequence[Prompt]) -> list[EpisodeContext]:
        """The prompts' episode contexts, with the next request ids (the group ids follow the same counter)."""
        ctxs = [EpisodeContext(self.engine, self.sampling, f"{self.writer_id}:{self.counter + i}",
                               resume_aborted=self.resume_aborted, stopping=self.stopping)
                for i in range(len(prompts))]
        self.counter += len(prompts)
        return ctxs

    async def _rollout(self, prompts: Sequence[Prompt], ctxs: list[EpisodeContext]) -> list[list[Sample]]:
        self._contexts += ctxs
        try:
            return list(await asyncio.gather(*(self.episode.run_group(c, p) for c, p in zip(ctxs, prompts))))
        finally:
            mine = {id(c) for c in ctxs}
            self._contexts = [c for c in self._contexts if id(c) not in mine]

    def stop(self) -> None:
        """The role is stopping: episodes in flight continue no aborted sample."""
        self.stopping = True
        for c in self._contexts:
            c.stopping = True

    # ------------------------------------------------------------------------------------------ sync parts
    def call(self, coro: Coroutine[Any, Any, T] | asyncio.Future[T]) -> T:
        """Run one coroutine (``engine.receive(...)``, ``driver.rollout(...)``) or task (a started batch's) on the
        driver's loop."""
        return self._loop.run_until_complete(coro)

    def run_batch(self, prompts: Sequence[Prompt], timer: PhaseTimer | None = None) -> BatchResult:
        """Generate, score, build and write the groups of ``prompts``; phases ``generate``, ``reward`` and
        ``store_write`` go to ``timer``."""
        timer = timer or PhaseTimer()
        first = self.counter
        with timer.phase("generate"):
            generated = self.call(self.rollout(prompts))
        return self._write(prompts, generated, first, timer)

    def start_batch(self, prompts: Sequence[Prompt], *, claimed: int | None = None) -> PendingBatch:
        """Start ``prompts`` on the driver's loop without waiting: their requests reach the engine when the loop
        next runs (any :meth:`call`), so they queue behind the batch in flight and take its slots as its rows end.
        ``claimed``: the groups of the admission claim the batch holds (released when it is written)."""
        first = self.counter  # taken now: a batch started after this one numbers its groups after it
        task = self._loop.create_task(self._rollout(prompts, self._take_contexts(prompts)))
        return PendingBatch(list(prompts), first, task, claimed)

    def finish_batch(self, batch: PendingBatch, timer: PhaseTimer | None = None) -> BatchResult:
        """Wait for a started batch, then score, build and write its groups (:meth:`run_batch`'s later phases)."""
        timer = timer or PhaseTimer()
        with timer.phase("generate"):
            generated = self.call(batch.task)
        return self._write(batch.prompts, generated, batch.first, timer, claimed=batch.claimed)

    def _write(self, prompts: Sequence[Prompt], generated: list[list[Sample]], first: int, timer: PhaseTimer, *,
               claimed: int | None = None) -> BatchResult:
        with timer.phase("reward"):
            scored = self.score(prompts, generated)
        groups, counts = build_groups(prompts, generated, scored, writer_id=self.writer_id, counter=first,
                                      default_version=self.engine.version)
        counts.update(self.episode.take_metrics())
        if self.rewards is not None:
            counts.update(self.rewards.metrics())  # a GenRM judge's genrm/* counters
        with timer.phase("store_write"):
            if groups and self.writer is not None:
                self.writer.write(groups)
            if self.admission is not None:  # after the shard is published: its groups now count in the backlog
                self.admission.release(claimed)
        return BatchResult(groups, generated, counts, scored.num_errors, sum(len(g) for g in generated))

    def score(self, prompts: Sequence[Prompt], generated: list[list[Sample]]) -> RewardResult:
        """Decode every response and score it: a ``RewardResult`` over the flat list, prompt by prompt. An episode
        that scores its own samples (multi-turn environments, :meth:`Episode.score`) does it instead."""
        own = self.episode.score(prompts, generated)
        if own is not None:
            return own
        if self.rewards is None:
            raise ValueError("the rollout driver has no reward and its episode scores nothing")
        texts = decode_texts(self.tokenizer, [t.response_ids for g in generated for t in g])
        answers = [p.answer for p, g in zip(prompts, generated) for _ in g]
        metas = [p.meta for p, g in zip(prompts, generated) for _ in g]
        if self.rewards.on_loop:  # a reward on the rollout's engine: on the engine's loop
            return self.call(self.rewards.score_async(texts, answers, metas))
        return self.rewards.score(texts, answers, metas)

    def close(self) -> None:
        """Close the engine and the loop."""
        with contextlib.suppress(Exception):
            self.call(self.engine.close())
        self._loop.close()


_NO_VERSIONS = np.zeros(0, np.int32)


def version_spans(samples: Sequence[Sample], default: int) -> tuple[list[int], list[int]]:
    """:meth:`Sample.version_range` of every sample at once: (oldest, newest) lists, over one concatenation of the
    per-token versions and two segment reductions instead of two reductions per sample."""
    n = len(samples)
    per_token = [_NO_VERSIONS if t.versions is None else t.versions for t in samples]
    lengths = np.fromiter((len(v) for v in per_token), dtype=np.int64, count=n)
    first, last = [default] * n, [default] * n
    filled = np.flatnonzero(lengths)
    if not len(filled):
        return first, last
    flat = np.concatenate([per_token[i] for i in filled.tolist()]).astype(np.int64, copy=False)
    starts = np.zeros(len(filled), dtype=np.int64)
    np.cumsum(lengths[filled][:-1], out=starts[1:])
    generated = flat >= 0  # context tokens (-1) have no version
    lo = np.minimum.reduceat(np.where(generated, flat, np.iinfo(np.int64).max), starts)
    hi = np.maximum.reduceat(np.where(generated, flat, -1), starts)
    for i, a, b in zip(filled.tolist(), lo.tolist(), hi.tolist()):
        if b >= 0:  # else only context tokens: the default
            first[i], last[i] = a, b
    return first, last


def build_groups(prompts: Sequence[Prompt], generated: list[list[Sample]], result: RewardResult, *, writer_id: str,
                 counter: int, default_version: int,
                 group_ids: Sequence[str] | None = None) -> tuple[list[SampleGroup], dict[str, float]]:
    """The store groups of scored samples: each sample gets its reward (and named parts), versions, group id
    (``<writer_id>:<counter + i>``, or ``group_ids[i]``), prompt (a sample without its own), the prompt's tensors and
    metadata, in place. A group with a sample whose reward
    failed under ``on_error=drop`` is dropped whole (counted). A sample's ``version`` is its oldest generated
    token's. A group without samples (every episode of a multi-turn group failed before finishing one) is left out
    (counted). Returns (groups, counts)."""
    groups: list[SampleGroup] = []
    dropped = empty = 0
    k = 0
    drop = np.asarray(result.dropped)
    extras = {name: np.asarray(v).tolist() for name, v in result.extras.items()}
    firsts, lasts = version_spans([t for group in generated for t in group], default_version)
    reward_list = np.asarray(result.rewards, dtype=np.float32).tolist()  # Python floats, as float(rewards[j]) gives
    for i, (prompt, group) in enumerate(zip(prompts, generated)):
        idx = range(k, k + len(group))
        k += len(group)
        if drop[idx.start:idx.stop].any():
            dropped += 1
            continue
        if not group:
            empty += 1
            continue
        group_id = f"{writer_id}:{counter + i}" if group_ids is None else group_ids[i]
        prompt_ids = None
        prompt_meta = {"prompt": prompt.meta} if prompt.meta else {}
        for j, s in zip(idx, group):
            if not len(s.prompt_ids):  # a sample of the prompt's (multi-turn samples carry their own)
                if prompt_ids is None:
                    prompt_ids = np.asarray(prompt.prompt_ids, dtype=np.int32)
                s.prompt_ids = prompt_ids
            s.reward = reward_list[j]
            s.rewards.update((n, float(v[j])) for n, v in extras.items())
            s.version, s.version_first, s.version_last = firsts[j], firsts[j], lasts[j]
            s.group_id = group_id
            if prompt.multimodal:
                s.tensors = dict(prompt.multimodal)
            s.metadata = {"finish_reason": s.finish_reason, **s.metadata, **prompt_meta}
        groups.append(SampleGroup(group_id=group_id, samples=list(group)))
    return groups, {"rollout/groups_dropped_reward_error": float(dropped), "rollout/groups_empty": float(empty)}
