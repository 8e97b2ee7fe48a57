"""Partial rollouts in colocate (``rollout.partial``, docs/partial-rollouts.md).

A step puts ``ceil(prompts_per_step x overprovision)`` groups in generation: the groups carried over from the last
step first (their samples continue from their tokens so far, as prefixes), then fresh prompts from the stream. Once
``prompts_per_step`` groups are *whole* (every sample ended with ``stop`` or ``length``), the engine aborts the rest
(:meth:`RolloutEngine.abort`); aborted samples come back with the tokens they had, each with the version that
produced it. The whole groups are scored, written to the sample store and trained on; the others go to the
:class:`CarryBuffer` and continue next step, unless their oldest token would then be more than ``max_staleness``
versions behind the trained version (dropped, counted, never written).

Exactly once: a group is written to the store once, when whole, and is never in the buffer afterwards; a group is in
the buffer or in the store, never both. The data cursor counts a prompt as taken when its group starts, so
``cursor + buffer`` is every prompt taken and not yet trained or dropped. The checkpoint holds the buffer's prompts
(epoch, dataset index); a resumed run starts them afresh from their prompts (:meth:`CarryBuffer.load_state`: their
tokens are not kept, so none is trained twice and none is lost).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from relax_hpc.errors import UserError
from relax_hpc.record import Sample
from relax_hpc.rollout.driver import BatchResult, Episode, EpisodeContext, RolloutDriver, build_groups
from relax_hpc.timing import PhaseTimer

if TYPE_CHECKING:
    from relax_hpc.config.rollout import PartialConfig
    from relax_hpc.data.dataset import Prompt

FINISHED = frozenset({"stop", "length"})


@dataclass(eq=False)
class PendingGroup:
    """A prompt's group in generation: its samples so far (none before its first step)."""

    prompt: Prompt
    group_id: str
    """Given when the group first starts; the store group's id when it is written."""
    samples: list[Sample] = field(default_factory=list)
    carries: int = 0
    """Steps it was carried into."""

    def whole(self) -> bool:
        """Every sample ended (``stop``/``length``): the group can be scored and trained."""
        return bool(self.samples) and all(s.finish_reason in FINISHED for s in self.samples)

    def oldest_version(self) -> int | None:
        """The oldest version among its generated tokens (None: no token yet)."""
        ages = [v[v >= 0] for v in (s.token_versions() for s in self.samples)]
        vs = [int(a.min()) for a in ages if len(a)]
        return min(vs) if vs else None

    def position(self) -> dict[str, int]:
        """The prompt's place in the data: what a checkpoint keeps of the group."""
        return {"epoch": int(self.prompt.meta.get("epoch", 0)), "index": int(self.prompt.meta["index"])}


def token_ages(samples: Sequence[Sample], version: int) -> np.ndarray:
    """Versions behind ``version`` of every generated token of ``samples`` (context tokens left out)."""
    vs = [s.token_versions() for s in samples]
    flat = np.concatenate(vs) if vs else np.zeros(0, np.int32)
    flat = flat[flat >= 0]
    return (version - flat.astype(np.int64)).clip(min=0)


def carry_metrics(samples: Sequence[Sample], version: int) -> dict[str, float]:
    """``rollout/carried_tokens`` (trained tokens generated before ``version``: in an earlier step),
    ``rollout/carried_age_mean`` (their mean versions behind) and ``rollout/staleness_mean`` (over every trained
    token)."""
    ages = token_ages(samples, version)
    carried = ages[ages > 0]
    return {"rollout/carried_tokens": float(len(carried)),
            "rollout/carried_age_mean": float(carried.mean()) if len(carried) else 0.0,
            "rollout/staleness_mean": float(ages.mean()) if len(ages) else 0.0}


class CarryBuffer:
    """The groups carried between steps, and those to start afresh after a resume."""

    def __init__(self, *, max_staleness: int):
        self.max_staleness = max_staleness
        self.groups: list[PendingGroup] = []
        self.restart: list[Prompt] = []
        """Prompts of groups that were carried when the checkpoint was taken: started afresh next step."""

    def __len__(self) -> int:
        return len(self.groups) + len(self.restart)

    def take(self, version: int) -> tuple[list[PendingGroup], list[Prompt], list[PendingGroup]]:
        """Empty the buffer for a step generating with ``version``: (groups to continue, prompts to restart, groups
        dropped because their oldest token would be more than ``max_staleness`` versions behind when trained)."""
        keep: list[PendingGroup] = []
        drop: list[PendingGroup] = []
        for g in self.groups:
            oldest = g.oldest_version()
            (drop if oldest is not None and version - oldest > self.max_staleness else keep).append(g)
        restart, self.groups, self.restart = self.restart, [], []
        return keep, restart, drop

    def put(self, groups: Sequence[PendingGroup]) -> None:
        for g in groups:
            g.carries += 1
        self.groups.extend(groups)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON): the positions of the buffer's prompts, in order."""
        restart = [{"epoch": int(p.meta.get("epoch", 0)), "index": int(p.meta["index"])} for p in self.restart]
        return {"prompts": restart + [g.position() for g in self.groups]}

    def load_state(self, state: Any, prompt_of: Callable[[int], Prompt]) -> None:
        """The buffer of a checkpoint: its prompts (``prompt_of(index)``) are started afresh next step."""
        entries = state.get("prompts") if isinstance(state, dict) else None
        if not isinstance(entries, list) or not all(
                isinstance(e, dict) and isinstance(e.get("epoch"), int) and isinstance(e.get("index"), int)
                for e in entries):
            raise UserError(f"checkpoint: partial-rollout state {state!r} is not {{'prompts': [{{'epoch': int, "
                            "'index': int}}, ...]}}")
        self.groups = []
        self.restart = []
        for e in entries:
            p = prompt_of(e["index"])
            p.meta["epoch"] = e["epoch"]
            self.restart.append(p)


async def _advance(ctx: EpisodeContext, episode: Episode, g: PendingGroup) -> PendingGroup:
    """Generate ``g`` until its samples end or are aborted: a fresh group through the episode, a carried one by
    continuing each aborted sample from its tokens."""
    if not g.samples:
        g.samples = await episode.run_group(ctx, g.prompt)
    else:
        await asyncio.gather(*(ctx.finish(g.prompt, s, tag=f"c{g.carries}") for s in g.samples))
    return g


async def generate_until(driver: RolloutDriver, groups: Sequence[PendingGroup], need: int) -> int:
    """Generate ``groups`` concurrently until ``need`` of them are whole, then abort the rest (their samples keep
    the tokens they had). Returns the samples aborted. The engine serves only these requests meanwhile (colocate),
    so the abort names none."""
    ctxs = [EpisodeContext(driver.engine, driver.sampling, g.group_id, resume_aborted=driver.resume_aborted,
                           stopping=driver.stopping) for g in groups]
    tasks = {asyncio.ensure_future(_advance(c, driver.episode, g)) for c, g in zip(ctxs, groups)}
    whole = 0
    try:
        while tasks and whole < need:
            done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            whole += sum(t.result().whole() for t in done)
        if not tasks:
            return 0
        for c in ctxs:
            c.stopping = True  # no aborted sample is continued this step
        await driver.engine.abort(None)
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    return sum(s.finish_reason == "abort" for g in groups for s in g.samples)


@dataclass
class PartialStep:
    """One step's outcome: the written groups (``result``) and what stays for later."""

    result: BatchResult
    unfinished: list[PendingGroup]


def run_groups(driver: RolloutDriver, groups: list[PendingGroup], need: int,
               timer: PhaseTimer | None = None) -> PartialStep:
    """Generate ``groups`` until ``need`` are whole (:func:`generate_until`), score and write the whole ones (under
    their own group ids) and return them with the unfinished ones."""
    timer = timer or PhaseTimer()
    with timer.phase("generate"):
        aborted = driver.call(generate_until(driver, groups, need))
    whole = [g for g in groups if g.whole()]
    prompts, generated = [g.prompt for g in whole], [g.samples for g in whole]
    with timer.phase("reward"):
        scored = driver.score(prompts, generated)
    written, counts = build_groups(prompts, generated, scored, writer_id=driver.writer_id, counter=0,
                                   default_version=driver.engine.version, group_ids=[g.group_id for g in whole])
    if driver.rewards is not None:
        counts.update(driver.rewards.metrics())
    with timer.phase("store_write"):
        if written and driver.writer is not None:
            driver.writer.write(written)
    counts["rollout/partial_aborted_samples"] = float(aborted)
    result = BatchResult(written, generated, counts, scored.num_errors, sum(len(g) for g in generated))
    return PartialStep(result, [g for g in groups if not g.whole()])


class PartialRollouts:
    """A colocate rank's partial rollouts: the carry buffer, and each step's groups from it and the stream."""

    def __init__(self, cfg: PartialConfig, *, prompts_per_step: int, max_staleness: int, driver: RolloutDriver):
        self.cfg, self.driver = cfg, driver
        self.need = prompts_per_step
        self.start = math.ceil(prompts_per_step * cfg.overprovision)
        self.buffer = CarryBuffer(max_staleness=max_staleness)

    def _new(self, prompts: Sequence[Prompt]) -> list[PendingGroup]:
        d = self.driver
        out = [PendingGroup(p, f"{d.writer_id}:{d.counter + i}") for i, p in enumerate(prompts)]
        d.counter += len(prompts)
        return out

    def step(self, take: Callable[[int], list[Prompt]], timer: PhaseTimer | None = None) -> BatchResult:
        """One step: the buffer's groups (stale ones dropped), then ``take(k)`` fresh prompts up to the step's
        start count; generate, write the whole groups, keep (or drop, without ``carry_over``) the rest."""
        version = self.driver.engine.version
        carried, restart, stale = self.buffer.take(version)
        groups = carried + self._new(restart)
        groups += self._new(take(max(0, self.start - len(groups))))
        step = run_groups(self.driver, groups, self.need, timer)
        unfinished = step.unfinished
        if self.cfg.carry_over:
            self.buffer.put(unfinished)
        counts = step.result.counts
        counts.update(carry_metrics([s for g in step.result.generated for s in g], version))
        counts.update({
            "rollout/partial_started_groups": float(len(groups)),
            "rollout/partial_continued_groups": float(len(carried)),
            "rollout/partial_restarted_groups": float(len(restart)),
            "rollout/partial_carried_groups": float(len(self.buffer)),
            "rollout/partial_dropped_groups": float(len(stale) + (0 if self.cfg.carry_over else len(unfinished))),
        })
        return step.result

    def state(self) -> dict[str, Any]:
        return self.buffer.state()

    def load_state(self, state: Any, prompt_of: Callable[[int], Prompt]) -> None:
        self.buffer.load_state(state, prompt_of)
