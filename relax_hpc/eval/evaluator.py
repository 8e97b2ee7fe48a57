"""One evaluation: the held-out prompts through a rollout engine at one weights version, scored, summarised, written.

Only the engine's ``generate`` API is used (:class:`~relax_hpc.rollout.engine.RolloutEngine`), so any engine (the
colocate engine on the trainer's module, a fully_async worker's engine, a server engine, an engine loading a stored
snapshot) evaluates the same way. Requests carry no seed of their own, so the engine batches them as it batches
rollouts (greedy evaluations are deterministic; sampled ones draw from the engine's seeded generator).

Results: ``RUN_DIR/eval/vNNNNNN.json`` (``{"version", "metrics", "time", "proc", "seconds"}``, atomically) and
``vNNNNNN.samples.jsonl`` (one line per sample, each with the version), see :meth:`relax_hpc.rundir.RunDir.evals`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.eval.heldout import HeldOut, load_heldout
from relax_hpc.eval.metrics import PromptOutcome, summarize
from relax_hpc.fsio import atomic_write_json, atomic_write_text
from relax_hpc.rundir import RunDir

log = logging.getLogger(__name__)
T = TypeVar("T")
Runner = Callable[[Coroutine[Any, Any, Any]], Any]
"""Runs one coroutine to completion on the loop the engine lives on (``RolloutDriver.call``, ``asyncio.run``)."""


@dataclass
class EvalResult:
    version: int
    metrics: dict[str, float]
    samples: list[dict[str, Any]]
    seconds: float


class Evaluator:
    """The held-out set of a recipe, ready to evaluate any engine."""

    def __init__(self, cfg: RecipeConfig, tokenizer: Any, *, rewards: Any = None, heldout: HeldOut | None = None):
        if cfg.eval is None:
            raise ValueError("the recipe has no eval section")
        self.cfg, self.ecfg, self.tokenizer = cfg, cfg.eval, tokenizer
        self.heldout = heldout or load_heldout(cfg, tokenizer)
        if rewards is None:
            from relax_hpc.modes.components import build_reward_runner

            rewards = build_reward_runner(cfg, tokenizer=tokenizer, name="eval")
        self.rewards = rewards

    def sampling(self) -> Any:
        from relax_hpc.rollout.engine import SamplingParams

        s, roll = self.ecfg.sampling, self.cfg.rollout.sampling
        return SamplingParams(n=self.ecfg.n_samples, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                              max_new_tokens=s.max_new_tokens or roll.max_new_tokens,
                              stop=tuple(roll.stop if s.stop is None else s.stop))

    async def generate(self, engine: Any, version: int) -> list[Any]:
        """Every held-out prompt's result, ``batch_prompts`` requests in flight at a time."""
        import asyncio

        from relax_hpc.rollout.engine import GenerateRequest

        prompts, out = self.heldout.prompts, []
        step = self.ecfg.batch_prompts
        for start in range(0, len(prompts), step):
            reqs = [GenerateRequest(f"eval-v{version}:{i}", p.prompt_ids, self.sampling(),
                                    media=p.media, engine_prompt_ids=p.engine_prompt_ids)
                    for i, p in enumerate(prompts[start:start + step], start)]
            out.extend(await asyncio.gather(*(engine.generate(r) for r in reqs)))
        return out

    def evaluate(self, engine: Any, version: int, run: Runner) -> EvalResult:
        """Generate with ``engine`` (which must hold weights ``version``), score and summarise."""
        from relax_hpc.models.load import decode_texts

        t0 = time.perf_counter()
        results = run(self.generate(engine, version))
        prompts = self.heldout.prompts
        flat = [(p, s) for p, r in zip(prompts, results, strict=True) for s in r.samples]
        texts = decode_texts(self.tokenizer, [s.token_ids for _, s in flat])
        answers, metas = [p.answer for p, _ in flat], [p.meta for p, _ in flat]
        if getattr(self.rewards, "on_loop", False):  # a reward on the rollout's engine: on the engine's loop
            scored = run(self.rewards.score_async(texts, answers, metas))
        else:
            scored = self.rewards.score(texts, answers, metas)
        rewards = [float(r) for r in scored.rewards]
        outcomes, samples, k = [], [], 0
        for i, (p, r) in enumerate(zip(prompts, results, strict=True)):
            n = len(r.samples)
            src = p.meta.get(self.ecfg.source_key)
            outcomes.append(PromptOutcome(rewards[k:k + n], [len(s.token_ids) for s in r.samples],
                                          [s.finish_reason == "length" for s in r.samples],
                                          None if src is None else str(src)))
            for j, s in enumerate(r.samples):
                samples.append({"version": version, "prompt_index": i, "sample": j, "source": src,
                                "answer": p.answer if isinstance(p.answer, str | int | float) else str(p.answer),
                                "response": texts[k + j], "reward": rewards[k + j],
                                "length": len(s.token_ids), "finish_reason": s.finish_reason})
            k += n
        metrics = summarize(outcomes, threshold=self.ecfg.threshold, pass_k=self.ecfg.pass_k)
        metrics["eval/heldout_overlap_dropped"] = float(self.heldout.overlap_dropped)
        metrics["eval/reward_errors"] = float(int(scored.failed.sum()))
        seconds = time.perf_counter() - t0
        metrics["eval/time"] = seconds
        return EvalResult(version, metrics, samples, seconds)


def write_result(run_dir: RunDir, result: EvalResult, *, proc: str) -> None:
    """The result's files: the samples first, then the summary (its presence says the evaluation is complete)."""
    run_dir.evals.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(s, default=str) + "\n" for s in result.samples)
    atomic_write_text(run_dir.eval_samples(result.version), lines)
    atomic_write_json(run_dir.eval_summary(result.version),
                      {"version": result.version, "metrics": result.metrics, "time": time.time(), "proc": proc,
                       "pid": os.getpid(), "seconds": result.seconds})


def read_results(run_dir: RunDir) -> dict[int, dict[str, float]]:
    """Version -> eval metrics of every complete evaluation of the run (unreadable files are skipped)."""
    from relax_hpc.fsio import read_json

    out: dict[int, dict[str, float]] = {}
    if not run_dir.evals.is_dir():
        return out
    for path in sorted(run_dir.evals.glob("v*.json")):
        try:
            rec = read_json(path, default=None)
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("version"), int) and isinstance(rec.get("metrics"), dict):
            out[rec["version"]] = {k: float(v) for k, v in rec["metrics"].items() if isinstance(v, int | float)}
    return out


def done_versions(run_dir: RunDir) -> set[int]:
    """Versions with a complete evaluation."""
    return set(read_results(run_dir))
