"""Mode ``colocate``: one group of processes generates, then trains, strictly on-policy.

Each step: the next ``prompts_per_step`` prompts (each rank takes its slice) -> ``n_samples`` completions each from
the in-memory policy -> rewards -> groups written to the sample store (so the monitor and resume work as in
fully_async) -> the leader plans the step's batch from the store -> every rank trains on its part -> the generation
weights are the trained weights (same module, updated in memory). Snapshots are published every
``weights.publish_every`` steps, checkpoints every ``trainer.checkpoint_every`` steps and on SIGUSR2/SIGTERM.
"""

from __future__ import annotations

import gc
import logging
import time
import uuid
from typing import Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.events import EventLog, Heartbeat
from relax_hpc.launch.exitcodes import EXIT_OK, EXIT_REQUEUE
from relax_hpc.launch.signals import StopFlag
from relax_hpc.rundir import RunDir

log = logging.getLogger(__name__)


def run_colocate(run_dir: RunDir, cfg: RecipeConfig, *, rank: int = 0, world_size: int = 1) -> int:
    """Run the whole colocate loop in this process. Returns an exit code (0 done, 3 checkpointed on a signal)."""
    from relax_hpc.modes import components as C
    from relax_hpc.rollout.groups import build_groups, samples_to_items, score_completions
    from relax_hpc.store import ConsumerGroup, ShardWriter
    from relax_hpc.trainer.prepare import prepare_items
    from relax_hpc.trainer.session import TrainerSession
    from relax_hpc.trainer.sft import run_warmup
    from relax_hpc.trainer.torch_trainer import TorchTrainer

    stop = StopFlag()
    events = EventLog(run_dir, "colocate", rank)
    hb = Heartbeat(run_dir, "colocate", rank)
    hb.start_thread()
    events.event("started", f"colocate rank {rank}/{world_size}")
    C.check_backends(cfg)
    C.seed_everything(cfg.seed)
    policy = C.build_policy(cfg, device_pref=cfg.trainer.device)
    algorithm = C.build_algorithm(cfg)
    ref, teacher = C.build_aux_models(cfg, policy)
    trainer = TorchTrainer(cfg, policy.model, device=policy.device, dtype=policy.dtype, algorithm=algorithm,
                           ref_model=ref, teacher=teacher, world_size=world_size, rank=rank)
    session = TrainerSession(run_dir, cfg, trainer, policy.tokenizer, events, rank=rank)
    engine = C.build_engine(cfg, policy, seed=cfg.seed + rank)
    stream = C.build_prompt_stream(cfg, policy.tokenizer)
    rewards = C.build_reward_runner(cfg)
    writer_id = f"colocate-{rank}.{uuid.uuid4().hex[:8]}"
    writer = ShardWriter(run_dir, writer_id)
    consumer = ConsumerGroup(run_dir, "trainer", rank=rank, world_size=world_size, retention=cfg.store.retention)

    state = session.resume()
    plan_seq = -1
    if state is not None:
        stream.load_state(state["data"])
        consumer.resume(state["store_position"])
        plan_seq = int(state["store_position"].get("step", -1))
    elif cfg.warmup.steps:
        warm_stream = _warmup_stream(cfg, policy.tokenizer, C)
        m = run_warmup(policy.model, policy.tokenizer, warm_stream, steps=cfg.warmup.steps, lr=cfg.warmup.lr,
                       batch_size=cfg.warmup.batch_size, max_tokens=cfg.trainer.micro_batch_tokens,
                       device=policy.device)
        events.metrics(m, step=0)
        events.event("warmup_done", f"{cfg.warmup.steps} supervised warm-up steps", step=0)
    session.version = trainer.step
    engine.version = trainer.step
    if trainer.step == 0:
        session.publish()

    n = cfg.rollout.n_samples
    group_counter = 0
    gc.freeze()  # ~400k objects of torch/transformers out of the collector: a full collection took ~0.5 s, GIL held
    hb.beat(state="running", step=trainer.step, version=session.version, force=True)
    while trainer.step < cfg.num_steps and not stop.is_set:
        t_step = time.perf_counter()
        batch = stream.next_batch(cfg.rollout.prompts_per_step)
        mine = batch[rank::world_size]
        t0 = time.perf_counter()
        completions = engine.generate([p.prompt_ids for p in mine], n,
                                      multimodal=[p.multimodal for p in mine])
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, scored = score_completions(rewards, policy.tokenizer, mine, completions)
        t_reward = time.perf_counter() - t0
        groups, counts = build_groups(mine, completions, scored, writer_id=writer_id, counter=group_counter,
                                      version=session.version)
        group_counter += len(mine)
        t0 = time.perf_counter()
        if groups:
            writer.write(groups)
        t_write = time.perf_counter() - t0
        _barrier(world_size)
        t0 = time.perf_counter()
        plan_seq += 1
        if rank == 0:  # everything published now, of the current version (older leftovers are dropped, counted)
            plan = consumer.plan_available(plan_seq, 10**9, min_version=session.version)
        else:
            plan = consumer.wait_plan(plan_seq, timeout_s=cfg.store.wait_timeout_s)
        items = samples_to_items(consumer.read(plan))
        counts["rollout/stale_dropped"] = float(plan.stats.get("stale_dropped_samples", 0))
        t_read = time.perf_counter() - t0
        orphans = [it for it in items if it.version > session.version]  # generated by a branch lost in a crash
        if orphans:
            items = [it for it in items if it.version <= session.version]
            counts["rollout/orphaned_samples_dropped"] = float(len(orphans))
        t0 = time.perf_counter()
        prep = prepare_items(items, cfg, algorithm)
        t_prep = time.perf_counter() - t0
        metrics = trainer.train_step(prep.items)
        session.version = trainer.step
        engine.version = trainer.step
        t_sync = 0.0
        if trainer.step % cfg.weights.publish_every == 0 or trainer.step == cfg.num_steps:
            t_sync = session.publish()
        t_ckpt = time.perf_counter()
        if trainer.step % cfg.trainer.checkpoint_every == 0 or trainer.step == cfg.num_steps or stop.is_set:
            session.checkpoint({"data": stream.state(), "store_position": consumer.position_after(plan_seq)})
            if rank == 0:
                consumer.commit(consumer.position_after(plan_seq))
        t_ckpt = time.perf_counter() - t_ckpt
        step_time = time.perf_counter() - t_step
        nsamp = max(1, len(items))
        metrics.update(prep.metrics)
        metrics.update(counts)
        metrics.update({
            "perf/step_time": step_time, "perf/rollout_time": t_gen, "perf/reward_time": t_reward,
            "perf/update_weights_time": t_sync, "perf/samples_per_s": nsamp * world_size / step_time,
            "perf/store_write_time": t_write, "perf/store_read_time": t_read, "perf/prepare_time": t_prep,
            "perf/checkpoint_time": t_ckpt,
            "perf/tokens_per_s": metrics.get("train/tokens", 0.0) * world_size / step_time,
            "weights/version": float(session.version), "rollout/staleness_mean": 0.0,
            "reward/errors": float(getattr(scored, "num_errors", 0)),
        })
        session.log_metrics(metrics, trainer.step)
        hb.beat(step=trainer.step, version=session.version)
        log.info("step %d/%d reward %.3f loss %.4f (%.2fs)", trainer.step, cfg.num_steps,
                 metrics.get("rollout/reward", float("nan")), metrics.get("train/loss", float("nan")), step_time)
    if stop.is_set and trainer.step < cfg.num_steps:
        if session.last_checkpoint_step != trainer.step:
            session.checkpoint({"data": stream.state(), "store_position": consumer.position})
            if rank == 0:
                consumer.commit(consumer.position)
        session.close()
        events.event("preempted", "checkpointed after a signal; exiting for requeue", step=trainer.step)
        hb.stop("stopped")
        return EXIT_REQUEUE
    if cfg.trainer.export_final:
        session.export()
    if rank == 0:
        from relax_hpc.fsio import atomic_write_json

        atomic_write_json(run_dir.status_file, {"state": "completed", "steps": trainer.step, "time": time.time()})
    session.close()
    events.event("finished", f"done after {trainer.step} steps", step=trainer.step)
    hb.stop("stopped")
    return EXIT_OK


def _warmup_stream(cfg: RecipeConfig, tokenizer: Any, C: Any) -> Any:
    if cfg.warmup.task is None:
        return C.build_prompt_stream(cfg, tokenizer, seed_offset=10_000)
    data = cfg.data.model_copy(update={"task": cfg.warmup.task, "path": None})
    return C.build_prompt_stream(cfg.model_copy(update={"data": data}), tokenizer, seed_offset=10_000)


def _barrier(world_size: int) -> None:
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()
