"""Role ``rollout`` of mode ``fully_async``: generate groups with the latest published weights, write them to the
sample store, and pause when the store's backlog shows the trainer would find them too stale.

Admission control (:mod:`relax_hpc.modes.admission`): a batch generated now with weights ``v`` is consumed after
the backlog and the batches other workers are generating, so its staleness is about ``1 + ahead / prompts_per_step``
versions. A worker claims room for a batch only while ``ahead + batch <= max(max_staleness, 1) * prompts_per_step``;
otherwise it pauses (counted in ``perf/rollout_pause_time``). Weights are picked up between generation batches.
A worker stops when the run's STATUS.json appears, when asked to drain (control file), or on SIGTERM/SIGUSR2
(it is stateless: a restarted worker rejoins at the latest version with a new writer id).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.events import EventLog, Heartbeat
from relax_hpc.fsio import read_json, wait_for
from relax_hpc.launch.exitcodes import EXIT_OK, EXIT_REQUEUE
from relax_hpc.launch.signals import StopFlag
from relax_hpc.rundir import RunDir, proc_name

log = logging.getLogger(__name__)


def drain_requested(run_dir: RunDir, proc: str) -> bool:
    req = read_json(run_dir.control_file(proc), default=None)
    return isinstance(req, dict) and req.get("action") in ("drain", "stop")


def run_rollout_worker(run_dir: RunDir, cfg: RecipeConfig, *, rank: int = 0) -> int:
    """Generate until the run ends. Returns an exit code."""
    from relax_hpc.modes import components as C
    from relax_hpc.modes.admission import Admission
    from relax_hpc.rollout.groups import build_groups, score_completions
    from relax_hpc.store import ShardWriter, backlog, new_writer_id
    from relax_hpc.store.watch import files_watch
    from relax_hpc.weights import SnapshotReader, latest_version

    proc = proc_name("rollout", rank)
    stop = StopFlag()
    events = EventLog(run_dir, "rollout", rank)
    hb = Heartbeat(run_dir, "rollout", rank)
    hb.start_thread()
    writer_id = new_writer_id(proc)
    events.event("started", f"rollout worker {rank} (writer {writer_id})")
    C.check_backends(cfg)
    C.seed_everything(cfg.seed + 7919 * (rank + 1) + int(time.time()) % 100_003)
    policy = C.build_policy(cfg, device_pref=cfg.rollout.device)
    engine = C.build_engine(cfg, policy, seed=cfg.seed + rank)
    stream = C.build_prompt_stream(cfg, policy.tokenizer, seed_offset=1000 * (rank + 1) + int(time.time()) % 997)
    rewards = C.build_reward_runner(cfg)
    writer = ShardWriter(run_dir, writer_id)
    reader = SnapshotReader(run_dir, name=proc)
    fast = None
    if cfg.weights.fast_path != "off":
        from relax_hpc.weights.fastpath import FastPathClient, link_device

        fast = FastPathClient(run_dir, rank, device=link_device(cfg.weights.fast_path, policy.device))

    def finished() -> bool:
        return run_dir.status_file.exists()

    gc.freeze()  # ~400k objects of torch/transformers out of the collector: a full collection took ~0.5 s, GIL held
    first = wait_for(lambda: latest_version(run_dir) is not None or finished() or stop.is_set,
                     what="the first weight snapshot", timeout_s=cfg.store.wait_timeout_s, logger=log)
    del first
    P = cfg.rollout.prompts_per_step
    limit = max(cfg.max_staleness, 1) * P
    admission = Admission(run_dir, proc, limit=limit, max_age_s=max(600.0, 4 * cfg.monitor.dead_after_s))
    watch = files_watch(run_dir.consumer_planned("trainer"), run_dir.weights_latest, run_dir.claims)

    def store_backlog() -> int:
        return backlog(run_dir).groups
    hb.beat(state="running", force=True)
    counter = 0
    pause_total = 0.0
    carried = {"pause": 0.0, "sync": 0.0}  # pause and weight loads of passes that ended in a reload, not yet logged
    while not (finished() or stop.is_set or drain_requested(run_dir, proc)):
        t_sync = 0.0
        newest = latest_version(run_dir)
        sync_path = ""
        if newest is not None and (newest > engine.version or counter == 0):
            t0 = time.perf_counter()
            # the first weights come from the files (a late joiner starts at once); updates over the fast path
            got = fast.pull(engine.version, policy.model) if fast is not None and counter else None
            if got is not None and got >= newest:
                engine.version, sync_path = got, "fast"
            else:  # the files are the truth: late joiners, a broken link, or no fast path
                engine.version, sync_path = _load_latest(run_dir, reader, policy.model, cfg.weights.verify), "file"
            t_sync = time.perf_counter() - t0
            hb.beat(version=engine.version)
        t0 = time.perf_counter()
        paused = False
        seen = newest
        # The trainer frees room once per step: react within a millisecond (for the first second of a pause; then
        # every 20 ms). A poll is a few stats; the backlog, the claims and LATEST are read again only when the
        # planned position, the claims folder or LATEST changed (or every 50 ms).
        room = admission.try_claim(cfg.rollout.batch_prompts, store_backlog)
        while not room and not (finished() or stop.is_set):
            if not paused and time.perf_counter() - t0 > 0.5:  # the monitor shows pauses, not each step's wait
                hb.beat(state="paused")
                paused = True
            stop.wait(0.0005 if time.perf_counter() - t0 < 1.0 else 0.02)
            if watch.changed():
                newest = latest_version(run_dir)
                if newest is not None and newest != seen:
                    break  # new weights while paused: reload before generating
                room = admission.try_claim(cfg.rollout.batch_prompts, store_backlog)
        pause = time.perf_counter() - t0
        pause_total += pause
        if paused:
            hb.beat(state="running")
        if finished() or stop.is_set:
            break
        if newest is not None and newest != seen:
            carried["pause"] += pause
            carried["sync"] += t_sync
            continue
        if fast is not None and counter:  # the trainer hands new weights to the fast path before it frees room in
            t0 = time.perf_counter()  # the store, so they are often here before LATEST names them
            got = fast.pull(engine.version, policy.model)
            if got is not None and got > engine.version:
                engine.version, sync_path = got, "fast"
                hb.beat(version=engine.version)
            t_sync += time.perf_counter() - t0
        pause, t_sync = pause + carried["pause"], t_sync + carried["sync"]
        carried = {"pause": 0.0, "sync": 0.0}
        t0 = time.perf_counter()
        batch = stream.next_batch(cfg.rollout.batch_prompts)
        completions = engine.generate([p.prompt_ids for p in batch], cfg.rollout.n_samples,
                                      multimodal=[p.multimodal for p in batch])
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, scored = score_completions(rewards, policy.tokenizer, batch, completions)
        t_reward = time.perf_counter() - t0
        groups, counts = build_groups(batch, completions, scored, writer_id=writer_id, counter=counter,
                                      version=engine.version)
        counter += len(batch)
        t0 = time.perf_counter()
        if groups:
            writer.write(groups)
        admission.release()  # after the shard is published: its groups now count in the backlog
        t_write = time.perf_counter() - t0
        sync_metrics = {f"perf/update_weights_time_{sync_path}": t_sync} if sync_path else {}
        events.metrics({"rollout/generate_time": t_gen, "perf/rollout_pause_time": pause,
                        "perf/update_weights_time": t_sync, "rollout/version": float(engine.version),
                        "perf/reward_time": t_reward, "perf/store_write_time": t_write,
                        "weights/fast_path_used": float(sync_path == "fast"), **sync_metrics,
                        "rollout/groups": float(len(groups)), **counts}, step=engine.version)
        hb.beat(step=counter, version=engine.version)
    admission.release()
    if fast is not None:
        fast.close()
    events.event("stopped", f"rollout worker {rank} stopping after {counter} prompts "
                            f"(paused {pause_total:.1f}s)", step=engine.version)
    hb.stop("stopped")
    return EXIT_REQUEUE if stop.is_set and not finished() else EXIT_OK


def _load_latest(run_dir: RunDir, reader: Any, model: Any, verify: str, attempts: int = 20) -> int:
    """Load the newest complete snapshot. A snapshot can be retired between reading LATEST and taking the lease
    when the trainer publishes fast: then look again (bounded), rather than fail the worker."""
    from relax_hpc.errors import SnapshotError
    from relax_hpc.weights import latest_version

    last: Exception | None = None
    for _ in range(attempts):
        newest = latest_version(run_dir)
        try:
            return int(reader.load_into(model, newest, verify=verify))
        except SnapshotError as exc:
            last = exc
            time.sleep(0.05)
    raise SnapshotError(f"no snapshot could be loaded after {attempts} attempts: {last}")
