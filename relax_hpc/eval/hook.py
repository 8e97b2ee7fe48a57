"""Evaluation during training, called from the modes at the moment an engine holds new weights.

* colocate: the engine generates with the trainer's module; :meth:`EvalHook.on_weights` runs when the engine is
  handed a version (before the first step, after each step), between steps.
* fully_async: rollout worker ``eval.worker`` evaluates the snapshot its engine holds, between two of its batches,
  when a due version arrived (the versions it sees may skip some: the first version at or past each multiple of
  ``eval.every`` is evaluated), and the final snapshot when the run ends. Why a rollout worker and not an ``eval``
  role: the worker already holds the snapshot's weights in its engine at that version (no second copy of the model,
  no extra process or Slurm job to place and supervise), and the trainer never waits for it: it keeps consuming the
  store's backlog and the other workers' batches (with one worker, the trainer waits only once the backlog runs
  dry, as for any slow batch).

Each evaluation writes its files (:mod:`relax_hpc.eval.evaluator`) and an ``eval/*`` metrics record with the weight
version as its step to the role's event log (and its TensorBoard/W&B sinks). A version already evaluated (its
``eval/vNNNNNN.json`` exists: a resumed run) is not evaluated again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.eval.evaluator import Evaluator, Runner, done_versions, write_result
from relax_hpc.rundir import RunDir

if TYPE_CHECKING:
    from relax_hpc.weights.transport.base import WeightReceiver

log = logging.getLogger(__name__)


class EvalHook:
    """Evaluates due weight versions with one engine. ``enabled`` is False where this process does not evaluate
    (no ``eval`` section, another rollout worker, a trainer rank other than 0): then every call does nothing."""

    def __init__(self, run_dir: RunDir, cfg: RecipeConfig, tokenizer: Any, *, engine: Any, run: Runner, events: Any,
                 proc: str, enabled: bool = True, sinks: Any = None, own_sinks: bool = False):
        self.run_dir, self.cfg, self.engine, self.run, self.events, self.proc = run_dir, cfg, engine, run, events, proc
        self.enabled = enabled and cfg.eval is not None
        self.sinks, self.own_sinks = sinks, own_sinks
        self.evaluator: Evaluator | None = None
        if self.enabled:
            self.evaluator = Evaluator(cfg, tokenizer)  # the held-out set is checked at start, not mid-run
            done = done_versions(run_dir)
            self.last: int | None = max(done) if done else None

    @classmethod
    def for_colocate(cls, loop: Any) -> EvalHook:
        """The hook of a colocate rank (rank 0 evaluates; its metrics go where the trainer's go)."""
        sess = loop.session
        return cls(sess.run_dir, loop.cfg, loop.role.policy.tokenizer, engine=loop.engine, run=loop.driver.call,
                   events=sess.events, proc=sess.events.proc, enabled=loop.rank == 0, sinks=sess.sinks)

    @classmethod
    def for_rollout_worker(cls, worker: Any) -> EvalHook:
        """The hook of a fully_async rollout worker (worker ``eval.worker`` evaluates, with its own sinks)."""
        cfg = worker.cfg
        enabled = cfg.eval is not None and worker.rank == cfg.eval.worker
        sinks = None
        if enabled and (cfg.monitor.tensorboard or cfg.monitor.wandb):
            from relax_hpc.monitor.sinks import make_sinks

            sinks = make_sinks(worker.run_dir, cfg.monitor, worker.proc, cfg.model_dump(mode="json"))
        return cls(worker.run_dir, cfg, worker.driver.tokenizer, engine=worker.engine, run=worker.driver.call,
                   events=worker.events, proc=worker.proc, enabled=enabled, sinks=sinks, own_sinks=True)

    def on_weights(self, version: int) -> dict[str, float] | None:
        """The engine now holds ``version``: evaluate it if due. Returns the metrics when it evaluated."""
        if not self.enabled or self.cfg.eval is None:
            return None
        final = version >= self.cfg.num_steps
        if not self.cfg.eval.due(version, self.last, final=final):
            return None
        return self._evaluate(version)

    def at_start(self, sync: WeightReceiver) -> dict[str, float] | None:
        """fully_async, before the worker's first batch: the trainer may be past version 0 already (another worker
        fed it while this one started), so load snapshot 0 itself (``sync``: the worker's
        :class:`~relax_hpc.weights.transport.base.WeightReceiver`) and evaluate it: the curve starts at the base model.
        Nothing when version 0 is evaluated already, not due, or no longer on disk."""
        if not self.enabled or self.cfg.eval is None or not self.cfg.eval.due(0, self.last, final=False):
            return None
        if not self.run_dir.snapshot(0).exists():
            return None
        try:
            self.run(sync.load_files(0))
        except Exception as exc:  # an evaluation must not fail the worker
            log.warning("evaluation of v0: cannot load snapshot v0: %s", exc)
            return None
        return self.on_weights(0)

    def at_end(self, sync: WeightReceiver) -> dict[str, float] | None:
        """fully_async, when the worker stops: if the run finished and its final snapshot was not evaluated, load it
        (``sync``: the worker's :class:`~relax_hpc.weights.transport.base.WeightReceiver`) and evaluate it. Closes the
        hook's own sinks."""
        try:
            return self._final(sync)
        finally:
            if self.own_sinks and self.sinks is not None:
                self.sinks.close()
                self.sinks = None

    def _final(self, sync: WeightReceiver) -> dict[str, float] | None:
        if not self.enabled or self.cfg.eval is None or not self.cfg.eval.at_end:
            return None
        if not self.run_dir.status_file.exists():
            return None  # stopped early (drain, preemption): the run is not over
        newest = sync.newest()
        if newest is None or (self.last is not None and newest <= self.last):
            return None
        try:
            if newest > self.engine.version:
                self.run(sync.update(files_first=True))
        except Exception as exc:  # the final evaluation must not turn a finished run into a failed worker
            log.warning("final evaluation: cannot load snapshot v%d: %s", newest, exc)
            return None
        return self.on_weights(self.engine.version)

    def _evaluate(self, version: int) -> dict[str, float]:
        assert self.evaluator is not None
        log.info("evaluating weights v%d on %d held-out prompts", version, len(self.evaluator.heldout.prompts))
        res = self.evaluator.evaluate(self.engine, version, self.run)
        write_result(self.run_dir, res, proc=self.proc)
        self.last = version
        self.events.metrics(res.metrics, step=version)
        if self.sinks is not None:
            self.sinks.log(res.metrics, version)
        log.info("eval v%d: accuracy %.3f (thresholded %.3f) in %.1fs", version, res.metrics.get("eval/accuracy", 0),
                 res.metrics.get("eval/accuracy_thresholded", 0), res.seconds)
        return res.metrics
