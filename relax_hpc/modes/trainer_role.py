"""What the trainer side of both modes shares: setting the role up (model, optimizer, session, store consumer,
resume or warm-up), publishing snapshot files in the background, and ending the role (checkpoint on a signal and
exit for requeue, or export, mark the run completed and exit)."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.events import EventLog, Heartbeat
from relax_hpc.fsio import atomic_write_json
from relax_hpc.launch.exitcodes import EXIT_OK, EXIT_REQUEUE
from relax_hpc.launch.signals import StopFlag
from relax_hpc.rundir import RunDir


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
    trainer: Any
    """The :class:`~relax_hpc.trainer.torch_trainer.TorchTrainer`."""
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
    from relax_hpc.store import ConsumerGroup
    from relax_hpc.trainer.session import TrainerSession
    from relax_hpc.trainer.sft import run_warmup
    from relax_hpc.trainer.torch_trainer import TorchTrainer

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
    trainer = TorchTrainer(cfg, policy.model, device=policy.device, dtype=policy.dtype, algorithm=algorithm,
                           ref_model=ref, teacher=teacher, world_size=world_size, rank=rank)
    session = TrainerSession(run_dir, cfg, trainer, policy.tokenizer, events, rank=rank)
    consumer = ConsumerGroup(run_dir, "trainer", rank=rank, world_size=world_size, retention=cfg.store.retention)
    state = session.resume()
    plan_seq = -1
    if state is not None:
        consumer.resume(state["store_position"])
        plan_seq = int(state["store_position"].get("step", -1))
    elif cfg.warmup.steps:
        m = run_warmup(policy.model, policy.tokenizer, warmup_stream(cfg, policy.tokenizer),
                       steps=cfg.warmup.steps, lr=cfg.warmup.lr, batch_size=cfg.warmup.batch_size,
                       max_tokens=cfg.trainer.micro_batch_tokens, device=policy.device)
        if rank == 0:
            events.metrics(m, step=0)
            events.event("warmup_done", f"{cfg.warmup.steps} supervised warm-up steps", step=0)
    session.version = trainer.step
    return TrainerRole(run_dir, cfg, rank, world_size, stop, events, hb, policy, algorithm, trainer, session,
                       consumer, state, plan_seq)


def warmup_stream(cfg: RecipeConfig, tokenizer: Any) -> Any:
    """The prompts of the supervised warm-up: the warm-up task's, else the recipe's data (another seed)."""
    from relax_hpc.modes import components as C

    if cfg.warmup.task is None:
        return C.build_prompt_stream(cfg, tokenizer, seed_offset=10_000)
    data = cfg.data.model_copy(update={"task": cfg.warmup.task, "path": None})
    return C.build_prompt_stream(cfg.model_copy(update={"data": data}), tokenizer, seed_offset=10_000)


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
        """Publish ``state_dict`` as ``version`` in the background; tensors that are live parameters are copied
        first, unless ``private`` says that none are (a copy nobody changes, e.g. the fast path's packed one)."""
        if self.pool is None:
            return
        self.drain()
        self.last_submit = time.monotonic()
        if private:
            self.pending = self.pool.submit(self._publish, version, state_dict)
            return
        live = set()  # tensors that are the live parameters (unsharded): copied, the optimizer changes them
        for p in self.session.trainer.model.parameters():
            with contextlib.suppress(RuntimeError):  # sharded parameters have no plain storage
                live.add(p.untyped_storage().data_ptr())
        sd = {k: v.detach().clone() if v.untyped_storage().data_ptr() in live else v for k, v in state_dict.items()}
        self.pending = self.pool.submit(self._publish, version, sd)

    def _publish(self, version: int, state_dict: dict[str, Any]) -> None:
        from relax_hpc.weights import latest_version

        latest = latest_version(self.session.run_dir)
        if latest is None or version > latest:
            self.session.publisher.publish(state_dict, version=version, step=version,
                                           model_config=getattr(self.session.trainer.model, "config", None))

    def drain(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.drain()
        if self.pool is not None:
            self.pool.shutdown()
