"""What the trainer side of both modes shares: setting the role up (model, optimizer, session, store consumer,
resume or warm-up) and ending the role (checkpoint on a signal and exit for requeue, or export, mark the run
completed and exit). The weight snapshots go through the transport (:mod:`relax_hpc.weights.transport`)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.events import EventLog, Heartbeat
from relax_hpc.fsio import atomic_write_json
from relax_hpc.lifecycle import EXIT_OK, EXIT_REQUEUE, StopFlag
from relax_hpc.rundir import RunDir

if TYPE_CHECKING:
    from relax_hpc.algorithms.base import Algorithm
    from relax_hpc.data.stream import PromptStream
    from relax_hpc.envs.warmup import EnvWarmupStream
    from relax_hpc.modes.components import Policy, Tokenizer
    from relax_hpc.store.consumer import ConsumerGroup
    from relax_hpc.trainer.backend import TrainerBackend
    from relax_hpc.trainer.session import TrainerSession


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
    policy: Policy
    """The policy model, tokenizer, device and dtype (:func:`relax_hpc.modes.components.build_policy`)."""
    algorithm: Algorithm
    trainer: TrainerBackend
    """The trainer backend (:func:`relax_hpc.trainer.backend.make_backend`)."""
    session: TrainerSession
    """The :class:`~relax_hpc.trainer.session.TrainerSession` (checkpoints, snapshots, metrics)."""
    consumer: ConsumerGroup
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


def make_consumer(run_dir: RunDir, cfg: RecipeConfig, trainer: TrainerBackend) -> ConsumerGroup:
    """This rank's reader of the sample store, laid out by the backend's data-parallel rank and size (ranks of one
    model replica read the same groups); trainer rank 0 leads (plans and commits)."""
    from relax_hpc.store import ConsumerGroup

    return ConsumerGroup(run_dir, "trainer", rank=trainer.dp_rank, world_size=trainer.dp_size,
                         leader=trainer.rank == 0, retention=cfg.store.retention, keep_plans=cfg.store.keep_plans)


def warmup_stream(cfg: RecipeConfig, tokenizer: Tokenizer) -> PromptStream | EnvWarmupStream:
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
