"""Metrics sinks beside the JSON-lines event log: TensorBoard and Weights & Biases, with the same metric names.

The trainer writes JSON lines itself (:class:`relax_hpc.events.EventLog`); :func:`make_sinks` builds the *extra*
sinks the recipe enables (``monitor.tensorboard``, ``monitor.wandb``) and returns them as one
:class:`MetricsSink`, a no-op when none is enabled. Heavy imports happen only for an enabled sink. A sink that fails
while logging (full disk, W&B trouble) is dropped with one warning: metrics sinks never stop training.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from relax_hpc.config.schema import MonitorConfig
from relax_hpc.rundir import RunDir

log = logging.getLogger(__name__)


class MetricsSink:
    """Receives one step's metrics at a time. The base class is the no-op sink."""

    name = "null"

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` (flat name -> number) for ``step``."""

    def close(self) -> None:
        """Flush and release resources (idempotent)."""


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """Numeric values only, as floats; the strings events.py uses for non-finite numbers become floats again."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool | int | float):
            out[k] = float(v)
        elif isinstance(v, str):
            try:
                f = float(v)
            except ValueError:
                continue
            if not math.isfinite(f):
                out[k] = f
    return out


class CompositeSink(MetricsSink):
    """Fans out to several sinks; drops (with a warning) any that raises."""

    name = "composite"

    def __init__(self, sinks: list[MetricsSink] | None = None):
        self.sinks = list(sinks or [])

    def log(self, metrics: dict[str, float], step: int) -> None:
        values = _numbers(metrics)
        for sink in list(self.sinks):
            try:
                sink.log(values, step)
            except Exception as exc:
                log.warning("metrics sink %s failed and is disabled: %s", sink.name, exc)
                self.sinks.remove(sink)
                self._close(sink)

    @staticmethod
    def _close(sink: MetricsSink) -> None:
        try:
            sink.close()
        except Exception as exc:
            log.warning("closing metrics sink %s failed: %s", sink.name, exc)

    def close(self) -> None:
        for sink in self.sinks:
            self._close(sink)
        self.sinks = []


class TensorBoardSink(MetricsSink):
    """Scalars to ``RUN_DIR/logs/tensorboard/<proc>/`` with TensorBoard's own event-file writer (no torch needed)."""

    name = "tensorboard"

    def __init__(self, logdir: Path, *, flush_secs: float = 30.0):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        self._event, self._summary = Event, Summary
        self._writer: Any = EventFileWriter(str(logdir), max_queue_size=100, flush_secs=flush_secs)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._writer is None:
            return
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self._writer.add_event(self._event(wall_time=time.time(), step=int(step),
                                           summary=self._summary(value=values)))

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink(MetricsSink):
    """One W&B run per process, in ``RUN_DIR/logs/wandb``; offline unless ``WANDB_MODE`` says otherwise."""

    name = "wandb"

    def __init__(self, wandb_dir: Path, *, project: str, name: str, group: str | None, config: dict[str, Any]):
        import wandb

        wandb_dir.mkdir(parents=True, exist_ok=True)
        mode: Any = os.environ.get("WANDB_MODE", "offline")
        self.run: Any = wandb.init(project=project, name=name, group=group, dir=str(wandb_dir), config=config,
                                   mode=mode, reinit="create_new")

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=int(step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def make_sinks(run_dir: RunDir | Path | str, monitor_cfg: MonitorConfig, proc: str,
               config: dict[str, Any]) -> MetricsSink:
    """The extra sinks ``monitor_cfg`` enables for process ``proc``, as one :class:`CompositeSink`.

    ``config`` (the resolved recipe as JSON) becomes the W&B run's config. A sink that cannot start (package not
    installed) is skipped with a warning naming the package to install.
    """
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    sinks: list[MetricsSink] = []
    if monitor_cfg.tensorboard:
        try:
            sinks.append(TensorBoardSink(rd.tensorboard_dir(proc)))
        except ImportError:
            log.warning("monitor.tensorboard is on but tensorboard is not installed (pip install tensorboard)")
    if monitor_cfg.wandb:
        try:
            run_name = str(config.get("name") or rd.root.name)
            sinks.append(WandbSink(rd.wandb, project=monitor_cfg.wandb_project, name=f"{run_name}-{proc}",
                                   group=run_name, config=config))
        except ImportError:
            log.warning("monitor.wandb is on but wandb is not installed (pip install wandb)")
    return CompositeSink(sinks)
