"""What every trainer-side loop shares: resume, periodic checkpoints, weight publishing, final export, metrics.

The checkpoint holds the model, optimizer, RNG states, the prompt stream's position (colocate), the sample store's
read position (so a resumed trainer neither skips nor repeats a shard) and the policy version. Its model and optimizer
come in one of two formats (:mod:`relax_hpc.trainer.checkpoint`), chosen once from the backend: gathered to rank 0
(the backend's ``checkpoint_state``; written in the loop or, with ``background``, on a writer thread), or the
backend's :class:`~relax_hpc.trainer.backend.ShardedCheckpoint`, where every rank writes its own shards. The sharded
save is a collective of every trainer rank, so it runs in the loop (the step waits for this rank's shards; a
background thread would have to make its collectives beside the training step's). Resuming reads whichever format
the latest checkpoint has; a sharded one loads only where the recipe has the settings it was written with.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.errors import UserError
from relax_hpc.events import EventLog
from relax_hpc.rundir import RunDir
from relax_hpc.trainer.checkpoint import (
    capture,
    latest_checkpoint,
    load_checkpoint,
    load_sharded_checkpoint,
    read_checkpoint_state,
    save_checkpoint,
    save_sharded_checkpoint,
)

if TYPE_CHECKING:
    from relax_hpc.trainer.backend import ShardedCheckpoint, TrainerBackend

log = logging.getLogger(__name__)


class MetricSink(Protocol):
    """Where a step's metrics go besides the event log (TensorBoard, W&B ...): built by the caller."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TrainerSession:
    """Checkpoint/publish bookkeeping around a :class:`~relax_hpc.trainer.backend.TrainerBackend` (rank 0 writes;
    all ranks gather). ``sinks`` receive rank 0's metrics too (the session closes them)."""

    def __init__(self, run_dir: RunDir, cfg: RecipeConfig, trainer: TrainerBackend, tokenizer: Any,
                 events: EventLog, *, rank: int = 0, sinks: MetricSink | None = None):
        from relax_hpc.weights import SnapshotPublisher, delta_policy

        self.run_dir = run_dir
        self.cfg = cfg
        self.trainer = trainer
        self.tokenizer = tokenizer
        self.events = events
        self.rank = rank
        self.publisher = SnapshotPublisher(run_dir, keep_last=cfg.weights.keep_last,
                                           delta=delta_policy(cfg.weights.delta)) if rank == 0 else None
        self.version = 0
        self.last_checkpoint_step = -1
        """The step of the last checkpoint taken (written, or being written in the background)."""
        self.sharded = trainer.sharded_checkpoint()
        """The backend's sharded checkpoint format (None: only the gathered one); its ``active`` says whether this
        run's checkpoints are written in it."""
        if self.sharded is not None and self.sharded.active and cfg.trainer.async_checkpoint and rank == 0:
            log.warning("trainer.async_checkpoint does not apply to the %r sharded checkpoints: every rank writes its "
                        "shards in the loop (a collective)", self.sharded.name)
        self._writer: Any = None
        self._pending: tuple[Future[Path], tuple[int, float, Callable[[], None] | None]] | None = None
        self.sinks = sinks if rank == 0 else None
        from relax_hpc.health import RunHealth

        self.health = RunHealth(cfg, events, emit=rank == 0)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """One step's metrics: the event log (always) and TensorBoard / W&B when the recipe enables them."""
        metrics.update(self.health.check(metrics, step))  # NaN/inf stops (or is skipped); hopeless runs alert
        if self.rank != 0:
            return
        self.events.metrics(metrics, step=step)
        if self.sinks is not None:
            self.sinks.log(metrics, step)

    def close(self) -> None:
        self.drain()
        if self._writer is not None:
            self._writer.shutdown()
        if self.sharded is not None:
            self.sharded.close()
        if self.sinks is not None:
            self.sinks.close()

    def resume(self) -> dict[str, Any] | None:
        """Load the latest checkpoint if there is one. Returns its state JSON (or None for a fresh start)."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return None
        state = read_checkpoint_state(path)
        if "sharded" in state:
            load_sharded_checkpoint(path, state, self._reader_of(path, state["sharded"]))
        else:
            model_sd, optim_sd, state = load_checkpoint(path)
            self.trainer.load_checkpoint_state(model_sd, optim_sd)
        self.trainer.step = int(state["step"])
        self.version = int(state.get("version", state["step"]))
        self.last_checkpoint_step = self.trainer.step
        self.events.event("resumed", f"resumed from {path.name}", step=self.trainer.step, checkpoint=str(path))
        log.info("resumed from %s (step %d, version %d)", path, self.trainer.step, self.version)
        return state

    def _reader_of(self, path: Path, info: dict[str, Any]) -> ShardedCheckpoint:
        """The backend's sharded format, if it reads checkpoint ``path`` (``info``: its state JSON's ``sharded``);
        otherwise one :class:`UserError` naming the settings the checkpoint loads with."""
        layout = info.get("layout") or {}
        # a setting this run's config has no field for (trainer.megatron.tp with trainer.backend: torch) is named by
        # the setting that selects its section (trainer.backend), which differs too
        differ = {k: v for k, v in layout.items() if _setting(self.cfg, k) not in (v, _ABSENT)}
        if self.sharded is not None and self.sharded.name == info.get("format") and not differ:
            return self.sharded
        want = ", ".join(f"{k}: {json.dumps(v)}" for k, v in (differ or layout).items())
        why = ("this run has " + ", ".join(f"{k}: {json.dumps(_setting(self.cfg, k))}" for k in differ) if differ
               else "this trainer has no reader for it here")
        also = f", or {info['elsewhere']}" if info.get("elsewhere") else ""
        raise UserError(f"{path} is a {info.get('format')!r} sharded checkpoint, which loads only with {want} ({why}); "
                        f"resume with those settings{also}")

    def checkpoint(self, extra_state: dict[str, Any], *, on_saved: Callable[[], None] | None = None,
                   background: bool = False) -> None:
        """Checkpoint the current step (every rank calls; rank 0 writes, or every rank its shards in the sharded
        format). ``on_saved`` runs on this thread once the checkpoint is durable (e.g. committing the store position
        it holds): before this returns or, with ``background``, when :meth:`poll` or :meth:`drain` finds the
        background write done. The content (weights, optimizer, RNG) is taken now either way; a background write
        holds one CPU copy of it. The sharded format is always written before this returns (module docstring)."""
        self.drain()
        if self.sharded is not None and self.sharded.active:
            self._checkpoint_sharded(self.sharded, extra_state, on_saved)
            return
        t0 = time.perf_counter()
        from relax_hpc.trainer.gpu_checkpoint import capture_on_gpu

        gpu = capture_on_gpu(self.trainer) if background else None  # one GPU: pinned copies on a side stream
        if gpu is None:
            model_sd, optim_sd = self.trainer.checkpoint_state()
        step = self.trainer.step
        self.last_checkpoint_step = step
        if self.rank != 0:
            if on_saved is not None:
                on_saved()
            return
        data = gpu[0] if gpu is not None else capture(model_sd, optim_sd, copy=background)
        state = {"version": self.version, **extra_state}
        job = (step, t0, on_saved)
        if not background:
            save_checkpoint(self.run_dir, step, data=data, state=state, keep=self.cfg.trainer.keep_checkpoints)
            self._saved(*job)
            return
        if self._writer is None:
            from concurrent.futures import ThreadPoolExecutor

            self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")

        def write() -> Path:
            if gpu is not None:
                gpu[1]()  # the copies into the pinned buffers are done
            return save_checkpoint(self.run_dir, step, data=data, state=state, keep=self.cfg.trainer.keep_checkpoints)

        self._pending = (self._writer.submit(write), job)

    def _checkpoint_sharded(self, sharded: ShardedCheckpoint, extra_state: dict[str, Any],
                            on_saved: Callable[[], None] | None) -> None:
        """Every rank writes its shards now; rank 0 publishes the step once every rank's part is in."""
        t0 = time.perf_counter()
        step = self.trainer.step
        self.last_checkpoint_step = step
        save_sharded_checkpoint(self.run_dir, step, sharded, rank=self.rank, world_size=self.trainer.world_size,
                                state={"version": self.version, **extra_state},
                                keep=self.cfg.trainer.keep_checkpoints, timeout_s=self.cfg.trainer.checkpoint_timeout_s)
        if self.rank == 0:
            self._saved(step, t0, on_saved)
        elif on_saved is not None:
            on_saved()

    def _saved(self, step: int, t0: float, on_saved: Callable[[], None] | None) -> None:
        self.events.event("checkpoint_saved", f"checkpoint at step {step}", step=step,
                          seconds=time.perf_counter() - t0)
        if on_saved is not None:
            on_saved()

    def poll(self) -> None:
        """Finish a background checkpoint whose write is done (its ``on_saved`` runs here); errors are raised."""
        if self._pending is not None and self._pending[0].done():
            self.drain()

    def drain(self) -> None:
        """Wait for a background checkpoint and finish it (raising its error, if any)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[0].result()
            self._saved(*pending[1])

    def publish(self, state_dict: dict[str, Any] | None = None) -> float:
        """Publish the current weights as snapshot ``version`` (= trainer step). Returns seconds spent."""
        t0 = time.perf_counter()
        sd = state_dict if state_dict is not None else self.trainer.full_state_dict()
        if self.rank == 0 and self.publisher is not None:
            version = self.trainer.step
            if self.publisher.is_new(version):  # never trips over a version already on disk
                self.publisher.publish(sd, version=version, step=self.trainer.step,
                                       model_config=self.trainer.hf_config(),
                                       generation_config=self.trainer.generation_config(),
                                       adapter=self.trainer.adapter_config())
            else:
                self.publisher.adopt(version)
        return time.perf_counter() - t0

    def export(self) -> None:
        """Write the final model in HF format (safetensors + config + tokenizer) to RUN_DIR/export."""
        import shutil

        from relax_hpc.fsio import staged_dir

        final = self.run_dir.export
        if self.rank != 0:
            self.trainer.export_hf(final, self.tokenizer)  # a collective: rank 0 writes
            return
        if final.exists():
            shutil.rmtree(final)
        with staged_dir(final) as tmp:
            self.trainer.export_hf(tmp, self.tokenizer)
        self.events.event("exported", f"final model exported to {final}", step=self.trainer.step, path=str(final))


_ABSENT = object()
"""The value of a setting the config has no field for."""


def _setting(cfg: RecipeConfig, dotted: str) -> Any:
    """The value of the recipe setting ``dotted`` (``trainer.megatron.tp``), :data:`_ABSENT` where the config has no
    such field (the section of a variant not selected)."""
    value: Any = cfg.model_dump(mode="json")
    for name in dotted.split("."):
        if not isinstance(value, dict) or name not in value:
            return _ABSENT
        value = value[name]
    return value
