"""Role ``rollout`` of mode ``fully_async``: generate groups with the latest published weights, write them to the
sample store, and pause when the store's backlog shows the trainer would find them too stale.

Generation, rewards, groups and the store write are the rollout driver's (:mod:`relax_hpc.rollout.driver`); the
worker holds no model: its engine loads its own weights, and new ones go in through ``engine.receive`` by the
recipe's transport (:func:`relax_hpc.weights.transport.make_receiver`: over a process group or into the servers
when the transport has such a path, the snapshot files the truth).

Admission control (:mod:`relax_hpc.rollout.admission`): a batch generated now with weights ``v`` is consumed after
the backlog and the batches other workers are generating, so its staleness is about ``1 + ahead / prompts_per_step``
versions. A worker claims room for a batch only while ``ahead + batch <= max(max_staleness, 1) * prompts_per_step``;
otherwise it pauses (counted in ``perf/rollout_pause_time``). Weights are picked up between generation batches. When
there is room for a further batch on top of the one in flight, the worker starts it before it waits for the one in
flight: its requests queue behind the tail and take the engine's slots as the tail's rows end (at most two batches in
flight; each written as its own shard, in order, releasing its part of the claim).
A worker stops when the run's STATUS.json appears, when asked to drain (control file), or on SIGTERM/SIGUSR2
(it is stateless: a restarted worker rejoins at the latest version with a new writer id).

Sampling and the prompt stream are seeded from the recipe seed, the worker index and how many times this worker
index started before in this run (:func:`relax_hpc.modes.components.worker_seeds`): a run is reproducible, and a
restarted worker does not repeat its predecessor's prompts.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Literal

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.eval.hook import EvalHook
from relax_hpc.events import EventLog, Heartbeat
from relax_hpc.fsio import read_json, wait_for
from relax_hpc.health import RunHealth
from relax_hpc.lifecycle import EXIT_OK, EXIT_REQUEUE, StopFlag
from relax_hpc.rundir import RunDir, proc_name
from relax_hpc.timing import PhaseTimer

if TYPE_CHECKING:
    from relax_hpc.rollout.driver import PendingBatch

log = logging.getLogger(__name__)

Outcome = Literal["room", "weights", "stop"]


def drain_requested(run_dir: RunDir, proc: str) -> bool:
    req = read_json(run_dir.control_file(proc), default=None)
    return isinstance(req, dict) and req.get("action") in ("drain", "stop")


def starts_before(run_dir: RunDir, proc: str) -> int:
    """How many times ``proc`` started before in this run (its ``started`` events)."""
    path = run_dir.event_log(proc)
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return 0
    return sum(1 for line in text.splitlines() if '"kind": "event"' in line and '"event": "started"' in line)


def run_rollout_worker(run_dir: RunDir, cfg: RecipeConfig, *, rank: int = 0) -> int:
    """Generate until the run ends. Returns an exit code."""
    worker = RolloutWorker(run_dir, cfg, rank)
    try:
        worker.start()
        while not worker.should_stop():
            worker.cycle()
    finally:
        worker.close()
    return EXIT_REQUEUE if worker.stop.is_set and not worker.finished() else EXIT_OK


class RolloutWorker:
    """One fully_async rollout worker: weights in, room claimed, a batch through the driver, metrics out."""

    def __init__(self, run_dir: RunDir, cfg: RecipeConfig, rank: int):
        from relax_hpc.models.load import load_tokenizer
        from relax_hpc.modes import components as C
        from relax_hpc.rollout.admission import Admission
        from relax_hpc.rollout.driver import RolloutDriver
        from relax_hpc.rollout.hf_engine import sampling_params
        from relax_hpc.store import ShardWriter, new_writer_id
        from relax_hpc.store.watch import files_watch
        from relax_hpc.weights.transport import make_receiver

        self.run_dir, self.cfg, self.rank = run_dir, cfg, rank
        self.proc = proc = proc_name("rollout", rank)
        self.stop = StopFlag()
        incarnation = starts_before(run_dir, proc)
        self.events = EventLog(run_dir, "rollout", rank)
        self.hb = Heartbeat(run_dir, "rollout", rank)
        self.hb.start_thread()
        writer_id = new_writer_id(proc)
        self.events.event("started", f"rollout worker {rank} (writer {writer_id}, start {incarnation + 1})")
        self.health = RunHealth(cfg, self.events)  # alerts on runs that cannot learn
        C.check_backends(cfg)
        seed, stream_offset = C.worker_seeds(cfg, rank, incarnation)
        C.seed_everything(seed)
        tok = load_tokenizer(cfg.model)
        self.engine = C.build_engine(cfg, tok, seed=seed, run_dir=run_dir, proc=proc, events=self.events)
        self.stream = C.build_rollout_stream(cfg, tok, seed_offset=stream_offset)
        self.admission = Admission(run_dir, proc, limit=max(cfg.max_staleness, 1) * cfg.rollout.prompts_per_step,
                                   max_age_s=max(600.0, 4 * cfg.monitor.dead_after_s))
        self.driver = RolloutDriver(self.engine, tok, C.build_reward_runner(cfg, engine=self.engine, tokenizer=tok,
                                                                      name=writer_id),
                                    sampling=sampling_params(cfg.rollout.sampling, cfg.rollout.n_samples),
                                    writer_id=writer_id, writer=ShardWriter(run_dir, writer_id),
                                    episode=C.build_episode(cfg, tok),
                                    admission=self.admission)
        self.sync = make_receiver(cfg, self.engine, run_dir=run_dir, rank=rank, proc=proc, events=self.events)
        self.watch = files_watch(run_dir.consumer_planned("trainer"), run_dir.weights_latest, run_dir.claims)
        self.pause_total = 0.0
        self.inflight: PendingBatch | None = None
        """A batch started and not written yet (started while the one before it decoded its tail)."""
        self.carried = PhaseTimer()  # pause and weight loads of cycles that ended in a reload, not yet logged
        self.evals = EvalHook.for_rollout_worker(self)  # held-out evaluation of due snapshots (worker eval.worker)

    # ------------------------------------------------------------------------------------------ the loop
    def finished(self) -> bool:
        return self.run_dir.status_file.exists()

    def should_stop(self) -> bool:
        return self.finished() or self.stop.is_set or drain_requested(self.run_dir, self.proc)

    def start(self) -> None:
        from relax_hpc.modes.components import settle_gc

        settle_gc()  # torch/transformers out of the collector; fewer young collections per step
        wait_for(lambda: self.sync.newest() is not None or self.finished() or self.stop.is_set,
                 what="the first weight snapshot", timeout_s=self.cfg.store.wait_timeout_s, logger=log)
        if self.sync.newest() is not None:
            self.evals.at_start(self.sync)
        self.hb.beat(state="running", force=True)

    def cycle(self) -> None:
        """Weights if newer, room for a batch (unless one is in flight), the batch; the next batch too if there is
        room for it now (its requests queue behind the batch's tail and take the engine's slots as its rows end);
        the batch written, its metrics."""
        timer = PhaseTimer()
        path = self._update_weights(timer)
        if self.inflight is None:
            outcome = self._wait_for_room(timer)
            if outcome == "stop":
                return
            if outcome == "weights":  # new weights while paused: reload before generating
                for k, v in timer.seconds.items():
                    self.carried.add(k, v)
                return
            for k, v in self.carried.seconds.items():
                timer.add(k, v)
            self.carried.reset()
        path = self._fast_pull(timer) or path
        if self.inflight is None:
            self.inflight = self._start(timer)
        batch, self.inflight = self.inflight, None
        if not self.should_stop() and self._room_for_more():
            self.inflight = self._start(timer)
        res = self.driver.finish_batch(batch, timer)
        res.counts["rollout/next_batch_started"] = float(self.inflight is not None)  # during this batch's tail
        self._log(res, timer, path)

    def _start(self, timer: PhaseTimer) -> PendingBatch:
        """The next batch, started (its claim is held)."""
        self.evals.on_weights(self.engine.version)
        with timer.phase("preprocess"):  # inline: the media are made now; with the pool: the wait for them
            prompts = self.stream.next_batch(self.cfg.rollout.batch_prompts)
        return self.driver.start_batch(prompts, claimed=self.cfg.rollout.batch_prompts)

    def _room_for_more(self) -> bool:
        """Room now for a batch on top of the one in flight (admission control counts both)."""
        from relax_hpc.store import backlog

        return self.admission.try_claim(self.cfg.rollout.batch_prompts, lambda: backlog(self.run_dir).groups,
                                        more=True)

    def _update_weights(self, timer: PhaseTimer) -> str:
        newest = self.sync.newest()
        first = self.driver.counter == 0
        if newest is None or not (newest > self.engine.version or first):
            return ""
        with timer.phase("sync"):
            _, path = self.driver.call(self.sync.update(files_first=first))
        self.hb.beat(version=self.engine.version)
        return path

    def _fast_pull(self, timer: PhaseTimer) -> str:
        """The trainer hands new weights to the fast path before it frees room in the store, so they are often
        here before LATEST names them."""
        if not self.sync.fast or self.driver.counter == 0:
            return ""
        have = self.engine.version
        with timer.phase("sync"):
            got = self.driver.call(self.sync.pull())
        if got is None or got <= have:
            return ""
        self.hb.beat(version=self.engine.version)
        return "fast"

    def _wait_for_room(self, timer: PhaseTimer) -> Outcome:
        """Claim room for the next batch, pausing while there is none. The trainer frees room once per step: react
        within a millisecond (for the first second of a pause; then every 20 ms). A poll is a few stats; the
        backlog, the claims and LATEST are read again only when the planned position, the claims folder or LATEST
        changed (or every 50 ms)."""
        from relax_hpc.store import backlog

        groups = self.cfg.rollout.batch_prompts

        def store_backlog() -> int:
            return backlog(self.run_dir).groups

        t0 = time.perf_counter()
        seen = self.sync.newest()
        paused = False
        outcome: Outcome = "room"
        with timer.phase("pause"):
            room = self.admission.try_claim(groups, store_backlog)
            while not room and not (self.finished() or self.stop.is_set):
                waited = time.perf_counter() - t0
                if not paused and waited > 0.5:  # the monitor shows pauses, not each step's wait
                    self.hb.beat(state="paused")
                    paused = True
                self.stop.wait(0.0005 if waited < 1.0 else 0.02)
                if self.watch.changed():
                    newest = self.sync.newest()
                    if newest is not None and newest != seen:
                        outcome = "weights"
                        break
                    room = self.admission.try_claim(groups, store_backlog)
        self.pause_total += timer.get("pause")
        if paused:
            self.hb.beat(state="running")
        return "stop" if self.finished() or self.stop.is_set else outcome

    def _log(self, res: Any, timer: PhaseTimer, path: str) -> None:
        v = self.engine.version
        sync = timer.get("sync")
        self.events.metrics({
            **timer.metrics({"preprocess": "perf/preprocess_wait_time",
                             "generate": "rollout/generate_time", "pause": "perf/rollout_pause_time",
                             "sync": "perf/update_weights_time", "reward": "perf/reward_time",
                             "store_write": "perf/store_write_time"}),
            "rollout/version": float(v), "weights/fast_path_used": float(path == "fast"),
            **({f"perf/update_weights_time_{path}": sync} if path else {}),
            "rollout/groups": float(len(res.groups)), **res.counts, **self.stream.stats(),
            **self.engine.metrics()}, step=v)
        self.health.check({"reward/errors": float(res.reward_errors), "reward/samples": float(res.samples)}, v)
        self.hb.beat(step=self.driver.counter, version=v)

    def _end_inflight(self, batch: PendingBatch) -> None:
        """The batch started on top of the last one, at a stop: written whole (a drain, a signal: as a batch in
        progress always was), or, once the run is finished, aborted and not written."""
        try:
            if self.finished():
                self.driver.call(self.engine.abort(None))
                self.driver.call(batch.task)  # its samples end aborted; nothing is written
            else:
                self.driver.finish_batch(batch)
        except Exception:  # the engine may be what stopped the worker
            log.exception("rollout worker %d: the batch in flight at the stop was not written", self.rank)

    def close(self) -> None:
        self.driver.stop()
        if self.inflight is not None:
            self._end_inflight(self.inflight)
            self.inflight = None
        self.admission.release()
        self.evals.at_end(self.sync)
        self.sync.close()
        self.driver.close()
        self.stream.close()
        self.events.event("stopped", f"rollout worker {self.rank} stopping after {self.driver.counter} prompts "
                                     f"(paused {self.pause_total:.1f}s)", step=self.engine.version)
        self.hb.stop("stopped")
