"""Mode ``colocate``: one group of processes generates, then trains, strictly on-policy.

Each step: the next ``prompts_per_step`` prompts (each rank takes its slice) -> the rollout driver
(:mod:`relax_hpc.rollout.driver`: ``n_samples`` completions each from the engine, which generates with the trainer's
own module -> rewards -> groups written to the sample store, so the monitor and resume work as in fully_async) ->
the leader plans the step's batch from the store -> every rank trains on its part -> the engine gets the new
version through the ``memory`` weight transport (:mod:`relax_hpc.weights.transport.memory`: the same module, updated
in memory, or a copy). Snapshots are published
every ``weights.publish_every`` steps, checkpoints every ``trainer.checkpoint_every`` steps and on SIGUSR2/SIGTERM.

With a server engine (``vllm``, ``sglang``) each rank starts its own server; it sleeps after generating
(``rollout.server.sleep_level``: its KV cache, and at level 2 its weights, freed for the trainer), wakes its weights'
memory after the optimizer step, loads the new version's snapshot files (the ``files`` transport,
:class:`relax_hpc.weights.transport.files.EngineFilesSender`), then wakes the rest. ``perf/sleep_s`` and
``perf/wake_s`` time the two ends.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from relax_hpc.config.schema import RecipeConfig, ServerRolloutBase
from relax_hpc.errors import UserError
from relax_hpc.eval.hook import EvalHook
from relax_hpc.rundir import RunDir
from relax_hpc.timing import PhaseTimer

if TYPE_CHECKING:
    from relax_hpc.rollout.engine import RolloutEngine
    from relax_hpc.rollout.partial import PartialRollouts

log = logging.getLogger(__name__)

PHASE_METRICS = {  # phase of the step timer -> metric
    "preprocess": "perf/preprocess_wait_time",
    "generate": "perf/rollout_time", "reward": "perf/reward_time", "store_write": "perf/store_write_time",
    "read": "perf/store_read_time", "prepare": "perf/prepare_time", "sync": "perf/update_weights_time",
    "checkpoint": "perf/checkpoint_time", "sleep": "perf/sleep_s", "wake": "perf/wake_s",
}


def run_colocate(run_dir: RunDir, cfg: RecipeConfig, *, rank: int = 0, world_size: int = 1,
                 wrap_engine: Callable[[RolloutEngine], RolloutEngine] | None = None) -> int:
    """Run the whole colocate loop in this process. Returns an exit code (0 done, 3 checkpointed on a signal).
    ``wrap_engine``: applied to the engine the loop builds (a length mix: :mod:`relax_hpc.bench.lengths`)."""
    loop = Colocate(run_dir, cfg, rank=rank, world_size=world_size, wrap_engine=wrap_engine)
    try:
        while loop.trainer.step < cfg.num_steps and not loop.role.stop.is_set:
            loop.step()
    finally:
        loop.close()
    return loop.finish()


class Colocate:
    """The state of one colocate rank between steps."""

    def __init__(self, run_dir: RunDir, cfg: RecipeConfig, *, rank: int, world_size: int,
                 wrap_engine: Callable[[RolloutEngine], RolloutEngine] | None = None):
        from relax_hpc.modes import components as C
        from relax_hpc.modes.trainer_role import start_trainer_role
        from relax_hpc.rollout.driver import RolloutDriver
        from relax_hpc.rollout.hf_engine import sampling_params
        from relax_hpc.rollout.server import sleep_level
        from relax_hpc.store import ShardWriter
        from relax_hpc.weights.transport import make_sender

        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.role = r = start_trainer_role(run_dir, cfg, "colocate", rank=rank, world_size=world_size)
        self.trainer, self.session, self.consumer, self.plan_seq = r.trainer, r.session, r.consumer, r.plan_seq
        tok = r.policy.tokenizer
        server = isinstance(cfg.rollout, ServerRolloutBase)  # a server process per rank, fed from the files
        shared = None if server else self.trainer.generation_model()
        # each rank's own engine model receives the whole state (a server reads the files rank 0 writes)
        self.trainer.state_on_every_rank = shared is None and not server
        where = {"run_dir": run_dir, "proc": f"colocate-{rank}", "events": r.events} if server else {}
        on_gpu = server and str(r.policy.device).startswith("cuda") and cfg.rollout.device != "cpu"
        device = r.policy.device if shared is not None else (str(r.policy.device) if on_gpu else None)
        self.engine = C.build_engine(cfg, tok, seed=cfg.seed + rank, model=shared, device=device,  # a server: on
                                     colocated=True, **where)  # the rank's GPU
        if wrap_engine is not None:
            self.engine = wrap_engine(self.engine)
        if self.engine.threaded:
            import torch

            torch.set_num_threads(1)  # this thread's torch ops are small; the engine's thread runs the heavy ones
        self.sleep_level = sleep_level(cfg) if self.engine.can_sleep else 0
        """How deep the engine sleeps while this rank trains (0 = never; ``rollout.server.sleep_level``)."""
        self.stream = C.build_rollout_stream(cfg, tok)
        if r.state is not None:
            self.stream.load_state(r.state["data"])
        writer_id = f"colocate-{rank}.{uuid.uuid4().hex[:8]}"
        self.driver = RolloutDriver(self.engine, tok, C.build_reward_runner(cfg, engine=self.engine, tokenizer=tok,
                                                                      name=writer_id),
                                    sampling=sampling_params(cfg.rollout.sampling, cfg.rollout.n_samples),
                                    writer_id=writer_id, writer=ShardWriter(run_dir, writer_id),
                                    episode=C.build_episode(cfg, tok))
        self.partial = self._partial_rollouts(r.state)
        # the engine generates with the weights in memory; the snapshot files are for the monitor and recovery
        self.sender = make_sender(cfg, self.session, run_dir=run_dir, rank=rank, device=str(r.policy.device),
                                  engine=self.engine, call=self.driver.call, events=r.events)
        self.sender.start(self.trainer.step)
        self.evals = EvalHook.for_colocate(self)  # held-out evaluation when the engine gets new weights
        self.evals.on_weights(self.trainer.step)
        if self.trainer.step == 0:
            self.session.publish()
        C.settle_gc()  # torch/transformers out of the collector; fewer young collections per step
        r.hb.beat(state="running", step=self.trainer.step, version=self.session.version, force=True)

    def _partial_rollouts(self, state: dict[str, Any] | None) -> PartialRollouts | None:
        """``rollout.partial``'s carry buffer (restored from the checkpoint: its prompts start afresh), or None. A
        checkpoint's carried prompts resumed without ``rollout.partial`` go first into the next batch."""
        from relax_hpc.data.stream import PromptStream
        from relax_hpc.rollout.partial import CarryBuffer, PartialRollouts

        cfg = self.cfg
        self._restart: list[Any] = []
        carried = (state or {}).get("partial")
        dataset = self.stream.dataset if isinstance(self.stream, PromptStream) else self.stream.stream.dataset
        if cfg.rollout.partial is None:
            buffer = CarryBuffer(max_staleness=cfg.max_staleness)
            if carried is not None:
                buffer.load_state(carried, dataset.prompt)
            self._restart = buffer.restart
            return None
        if self.world_size > 1:
            raise UserError("rollout.partial: one colocate rank only for now (each rank would carry its own "
                            "groups); drop rollout.partial or run one rank")
        partial = PartialRollouts(cfg.rollout.partial, prompts_per_step=cfg.rollout.prompts_per_step,
                                  max_staleness=cfg.max_staleness, driver=self.driver)
        if carried is not None:
            partial.load_state(carried, dataset.prompt)
        return partial

    def _next_batch(self, n: int) -> list[Any]:
        """The next ``n`` prompts: a checkpoint's carried prompts first (resumed without ``rollout.partial``)."""
        head, self._restart = self._restart[:n], self._restart[n:]
        return head + self.stream.next_batch(n - len(head))

    def _generate(self, timer: PhaseTimer) -> Any:
        """This rank's groups of the step, generated and written (with ``rollout.partial``: the whole ones)."""
        cfg = self.cfg
        if self.partial is not None:
            def take(n: int) -> list[Any]:
                with timer.phase("preprocess"):
                    return self.stream.next_batch(n)

            return self.partial.step(take, timer)
        with timer.phase("preprocess"):  # inline: the media are made now; with the pool: the wait for them
            batch = self._next_batch(cfg.rollout.prompts_per_step)
        return self.driver.run_batch(batch[self.rank::self.world_size], timer)

    def _on_engine_thread(self, fn: Any) -> Any:
        """``fn()`` on the in-process engine's thread where it has one (see ``HFEngine.run_on_thread``), else here."""
        return self.driver.call(self.engine.run_on_thread(fn)) if self.engine.threaded else fn()

    def step(self) -> None:
        """One step: generate and write this rank's groups, plan and read the step's batch, train, hand over."""
        from relax_hpc.trainer.prepare import prepare_items

        cfg, timer = self.cfg, PhaseTimer()
        res = self._generate(timer)
        with timer.phase("sleep"):  # a server frees its memory for the trainer until the new weights come
            self._sleep()
        _barrier(self.world_size)
        with timer.phase("read"):
            items, counts = self._read_batch()
        with timer.phase("prepare"):
            prep = prepare_items(items, cfg, self.role.algorithm)
        metrics = self._on_engine_thread(functools.partial(self.trainer.train_step, prep.items))
        self.session.version = self.trainer.step
        with timer.phase("wake"):
            self._wake(weights_only=True)
        with timer.phase("sync"):  # the engine's weights in memory; the files when due (one GPU: in the background)
            self.sender.send(self.trainer.step, final=self.trainer.step == cfg.num_steps)
        with timer.phase("wake"):
            self._wake()
        self.evals.on_weights(self.trainer.step)  # when due: on the engine, which now holds this version
        with timer.phase("checkpoint"):
            self._checkpoint_or_poll()
        metrics.update(prep.metrics)
        metrics.update({**res.counts, **counts, **self.stream.stats()})
        self._log(metrics, timer, res, len(items))

    def _sleep(self) -> None:
        if self.sleep_level:
            self.driver.call(self.engine.sleep(self.sleep_level))

    def _wake(self, *, weights_only: bool = False) -> None:
        """The weights' memory first (the new version goes there), the rest after it."""
        if self.sleep_level:
            self.driver.call(self.engine.wake(weights_only=weights_only))

    def _read_batch(self) -> tuple[list[Any], dict[str, float]]:
        """The step's batch from the store: everything published now, of the current version (older leftovers are
        dropped, counted); samples of a newer version come from a branch lost in a crash (dropped, counted)."""
        from relax_hpc.trainer.items import samples_to_items

        self.plan_seq += 1
        lag = self.cfg.max_staleness if self.partial is not None else 0  # carried groups' oldest tokens
        if self.rank == 0:
            plan = self.consumer.plan_available(self.plan_seq, 10**9,
                                                min_version=max(0, self.session.version - lag))
        else:
            plan = self.consumer.wait_plan(self.plan_seq, timeout_s=self.cfg.store.wait_timeout_s)
        items = samples_to_items(self.consumer.read(plan))
        counts = {"rollout/stale_dropped": float(plan.stats.get("stale_dropped_samples", 0))}
        orphans = [it for it in items if it.sample.version > self.session.version]
        if orphans:
            items = [it for it in items if it.sample.version <= self.session.version]
            counts["rollout/orphaned_samples_dropped"] = float(len(orphans))
        return items, counts

    def _checkpoint_or_poll(self) -> None:
        cfg, step, stop = self.cfg, self.trainer.step, self.role.stop
        if step % cfg.trainer.checkpoint_every == 0 or step == cfg.num_steps or stop.is_set:
            pos = self.consumer.position_after(self.plan_seq)
            self.session.checkpoint({**self._data_state(), "store_position": pos},
                                    on_saved=functools.partial(self.consumer.commit, pos),
                                    background=cfg.trainer.async_checkpoint and not stop.is_set)
        else:
            self.session.poll()

    def _log(self, metrics: dict[str, float], timer: PhaseTimer, res: Any, num_items: int) -> None:
        step_time = timer.elapsed()
        ws = self.world_size
        metrics.update(timer.metrics(PHASE_METRICS))
        metrics.setdefault("rollout/staleness_mean", 0.0)  # strictly on-policy, unless partial rollouts carried
        metrics.update({
            "perf/step_time": step_time, "perf/samples_per_s": max(1, num_items) * ws / step_time,
            "perf/tokens_per_s": metrics.get("train/tokens", 0.0) * ws / step_time,
            "weights/version": float(self.session.version),
            "reward/errors": float(res.reward_errors),
        })
        self.session.log_metrics(metrics, self.trainer.step)
        self.role.hb.beat(step=self.trainer.step, version=self.session.version)
        log.info("step %d/%d reward %.3f loss %.4f (%.2fs)", self.trainer.step, self.cfg.num_steps,
                 metrics.get("rollout/reward", float("nan")), metrics.get("train/loss", float("nan")), step_time)

    def close(self) -> None:
        """Stop the engine's thread (the trainer's module stays the trainer's) and the prompt stream's workers."""
        self.driver.close()
        self.stream.close()

    def finish(self) -> int:
        from relax_hpc.modes.trainer_role import end_trainer_role

        self.sender.close()
        return end_trainer_role(self.role, self._data_state)

    def _data_state(self) -> dict[str, Any]:
        """The data position, and the prompts taken but not trained yet (the carry buffer's), for a checkpoint."""
        out: dict[str, Any] = {"data": self.stream.state()}
        if self.partial is not None:
            out["partial"] = self.partial.state()
        elif self._restart:
            from relax_hpc.rollout.partial import CarryBuffer

            buffer = CarryBuffer(max_staleness=self.cfg.max_staleness)
            buffer.restart = list(self._restart)
            out["partial"] = buffer.state()
        return out


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()
