"""What the trainer side of both modes shares: setting the role up (model, optimizer, session, store consumer,
resume or warm-up), publishing snapshot files in the background, and ending the role (checkpoint on a signal and
exit for requeue, or export, mark the run completed and exit)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.events import EventLog, Heartbeat
from relax_hpc.fsio import atomic_write_json
from relax_hpc.lifecycle import EXIT_OK, EXIT_REQUEUE, StopFlag
from relax_hpc.rundir import RunDir

if TYPE_CHECKING:
    from relax_hpc.trainer.backend import TrainerBackend


@dataclass
class TrainerRole:
    """One trainer rank, set up by :func:`start_trainer_role`."""

    run_dir: RunDir
    cfg: RecipeConfig
    rank: int
    world_size: int
    stop: StopFlag
    events: EventLog
    hb: Heartbeat
    policy: Any
    """The policy model, tokenizer, device and dtype (:func:`relax_hpc.modes.components.build_policy`)."""
    algorithm: Any
    trainer: TrainerBackend
    """The trainer backend (:func:`relax_hpc.trainer.backend.make_backend`)."""
    session: Any
    """The :class:`~relax_hpc.trainer.session.TrainerSession` (checkpoints, snapshots, metrics)."""
    consumer: Any
    """This rank's :class:`~relax_hpc.store.ConsumerGroup` of the sample store."""
    state: dict[str, Any] | None
    """The state JSON of the checkpoint resumed from (None on a fresh start)."""
    plan_seq: int
    """The store plan sequence number reached (the resumed position's step, -1 on a fresh start)."""


def start_trainer_role(run_dir: RunDir, cfg: RecipeConfig, role: str, *, rank: int, world_size: int) -> TrainerRole:
    """Set up a trainer rank: logs and heartbeat, model and optimizer, resume from the latest checkpoint (the store
    position too) or, on a fresh start, the supervised warm-up."""
    from relax_hpc.modes import components as C
    from relax_hpc.monitor.sinks import make_sinks
    from relax_hpc.trainer.backend import make_backend
    from relax_hpc.trainer.session import TrainerSession

    stop = StopFlag()
    events = EventLog(run_dir, role, rank)
    hb = Heartbeat(run_dir, role, rank)
    hb.start_thread()
    events.event("started", f"{role} rank {rank}/{world_size}")
    C.check_backends(cfg)
    C.seed_everything(cfg.seed)
    policy = C.build_policy(cfg, device_pref=cfg.trainer.device)
    algorithm = C.build_algorithm(cfg)
    ref, teacher = C.build_aux_models(cfg, policy)
    trainer = make_backend(cfg, rank=rank, world_size=world_size, device=policy.device, dtype=policy.dtype,
                           algorithm=algorithm, tokenizer=policy.tokenizer, model=policy.model, ref_model=ref,
                           teacher=teacher)
    sinks = make_sinks(run_dir, cfg.monitor, events.proc, cfg.model_dump(mode="json")) if rank == 0 else None
    session = TrainerSession(run_dir, cfg, trainer, policy.tokenizer, events, rank=rank, sinks=sinks)
    consumer = make_consumer(run_dir, cfg, trainer)
    state = session.resume()
    plan_seq = -1
    if state is not None:
        consumer.resume(state["store_position"])
        # The checkpoint is durable, so its position is committed: a kill between a save and its commit left
        # position.json one checkpoint behind, and a run resumed at its last step saves no further checkpoint.
        if state["store_position"]:
            consumer.commit(state["store_position"])
        plan_seq = int(state["store_position"].get("step", -1))
    elif cfg.warmup.steps:
        m = trainer.sft_warmup(warmup_stream(cfg, policy.tokenizer), policy.tokenizer, steps=cfg.warmup.steps,
                               lr=cfg.warmup.lr, batch_size=cfg.warmup.batch_size,
                               max_tokens=cfg.trainer.micro_batch_tokens)
        if rank == 0:
            events.metrics(m, step=0)
            events.event("warmup_done", f"{cfg.warmup.steps} supervised warm-up steps", step=0)
    session.version = trainer.step
    return TrainerRole(run_dir, cfg, rank, world_size, stop, events, hb, policy, algorithm, trainer, session,
                       consumer, state, plan_seq)


def make_consumer(run_dir: RunDir, cfg: RecipeConfig, trainer: TrainerBackend) -> Any:
    """This rank's reader of the sample store, laid out by the backend's data-parallel rank and size (ranks of one
    model replica read the same groups); trainer rank 0 leads (plans and commits)."""
    from relax_hpc.store import ConsumerGroup

    return ConsumerGroup(run_dir, "trainer", rank=trainer.dp_rank, world_size=trainer.dp_size,
                         leader=trainer.rank == 0, retention=cfg.store.retention, keep_plans=cfg.store.keep_plans)


def warmup_stream(cfg: RecipeConfig, tokenizer: Any) -> Any:
    """The prompts of the supervised warm-up: the warm-up task's, else the recipe's data (another seed); with
    ``warmup.source: env``, the episode environment's examples on those prompts."""
    from relax_hpc.modes import components as C

    if cfg.warmup.task is None:
        stream = C.build_prompt_stream(cfg, tokenizer, seed_offset=10_000)
    else:
        data = cfg.data.model_copy(update={"task": cfg.warmup.task, "path": None})
        stream = C.build_prompt_stream(cfg.model_copy(update={"data": data}), tokenizer, seed_offset=10_000)
    if cfg.warmup.source == "data":
        return stream
    from relax_hpc.envs.warmup import EnvWarmupStream

    assert cfg.rollout.env is not None, "checked at validation"
    return EnvWarmupStream(cfg.rollout.env, tokenizer, stream, seed=cfg.seed + 10_000)


def end_trainer_role(r: TrainerRole, extra_state: Callable[[], dict[str, Any]],
                     status: dict[str, Any] | None = None) -> int:
    """End the role after its loop. Stopped by a signal before the last step: checkpoint (unless this step's
    checkpoint exists; ``extra_state()`` adds the data position), commit the store position, exit for requeue.
    Otherwise export the final model (if asked), write the run's STATUS.json (rank 0; ``status`` adds fields)."""
    trainer, session = r.trainer, r.session
    session.drain()  # a background checkpoint is durable (and its position committed) before anything else
    if r.stop.is_set and trainer.step < r.cfg.num_steps:
        if session.last_checkpoint_step != trainer.step:
            pos = r.consumer.position
            session.checkpoint({**extra_state(), "store_position": pos},
                               on_saved=functools.partial(r.consumer.commit, pos))
        session.close()
        r.events.event("preempted", "checkpointed after a signal; exiting for requeue", step=trainer.step)
        r.hb.stop("stopped")
        return EXIT_REQUEUE
    if r.cfg.trainer.export_final:
        session.export()
    if r.rank == 0:
        atomic_write_json(r.run_dir.status_file, {"state": "completed", "steps": trainer.step, "time": time.time(),
                                                  **(status or {})})
    session.close()
    r.events.event("finished", f"done after {trainer.step} steps", step=trainer.step)
    r.hb.stop("stopped")
    return EXIT_OK


class SnapshotFiles:
    """Writes the weight snapshot files of trainer rank 0 on one background thread, so that the next step does not
    wait for their fsyncs. Version order is kept: at most one publish is in flight and the next :meth:`submit` waits
    for it. Rollout workers see a version when its LATEST is written (or earlier over the fast path); the files stay
    the truth for late joiners and recovery. :meth:`drain` waits for the pending publish and re-raises its error."""

    def __init__(self, session: Any):
        self.session = session
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="snapshot") if session.publisher is not None else None
        self.pending: Future[None] | None = None
        self.last_submit = time.monotonic()
        """When the last version was handed to :meth:`submit` (``time.monotonic()``; creation counts as one)."""

    def submit(self, version: int, state_dict: dict[str, Any], *, private: bool = False) -> None:
        """Publish ``state_dict`` as ``version`` in the background. ``private``: nothing changes its tensors later
        (``full_state_dict(copy=True)``, the fast path's packed copy); otherwise the backend copies those that are
        live weights first."""
        if self.pool is None:
            return
        self.drain()
        self.last_submit = time.monotonic()
        sd = state_dict if private else self.session.trainer.detached(state_dict)
        self.pending = self.pool.submit(self._publish, version, sd)

    def _publish(self, version: int, state_dict: dict[str, Any]) -> None:
        trainer = self.session.trainer
        if self.session.publisher.is_new(version):  # never trips over a version already on disk
            self.session.publisher.publish(state_dict, version=version, step=version,
                                           model_config=trainer.hf_config(),
                                           generation_config=trainer.generation_config())

    def drain(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.drain()
        if self.pool is not None:
            self.pool.shutdown()
