"""Metrics sinks: no-op by default, TensorBoard and W&B (offline) with the trainer's metric names."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pytest

from relax_hpc.config.schema import MonitorConfig
from relax_hpc.monitor.sinks import CompositeSink, MetricsSink, make_sinks
from relax_hpc.rundir import RunDir


def test_no_sink_enabled_is_a_noop(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    sink = make_sinks(rd, MonitorConfig(), "trainer-0", {"name": "x"})
    assert isinstance(sink, CompositeSink) and sink.sinks == []
    sink.log({"train/loss": 1.0}, step=1)
    sink.close()
    assert not rd.tensorboard.exists() and not rd.wandb.exists()


def test_tensorboard_scalars_readable_by_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rd = RunDir.create(tmp_path / "run")
    sink = make_sinks(rd.root, MonitorConfig(tensorboard=True), "trainer-0", {"name": "x"})
    assert [s.name for s in sink.sinks] == ["tensorboard"]  # type: ignore[attr-defined]
    for step in range(1, 4):
        sink.log({"rollout/reward": 0.1 * step, "train/loss": float("nan") if step == 3 else 1.0 / step,
                  "weights/version": step, "note": "text is not a metric"}, step=step)
    sink.log({"train/loss": "inf"}, step=4)  # events.py's spelling of a non-finite number
    sink.close()
    sink.close()  # idempotent
    acc = EventAccumulator(str(rd.tensorboard_dir("trainer-0")))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["rollout/reward", "train/loss", "weights/version"]
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("rollout/reward")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    losses = [e.value for e in acc.Scalars("train/loss")]
    assert losses[:2] == [1.0, 0.5] and math.isnan(losses[2]) and losses[3] == math.inf


def test_failing_sink_is_dropped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    class Broken(MetricsSink):
        name = "broken"
        closed = False

        def log(self, metrics: dict[str, float], step: int) -> None:
            raise OSError("disk full")

        def close(self) -> None:
            Broken.closed = True

    seen: list[tuple[dict[str, float], int]] = []

    class Good(MetricsSink):
        def log(self, metrics: dict[str, float], step: int) -> None:
            seen.append((metrics, step))

    sink = CompositeSink([Broken(), Good()])
    with caplog.at_level(logging.WARNING):
        sink.log({"a": 1}, step=1)
        sink.log({"a": 2}, step=2)
    assert seen == [({"a": 1.0}, 1), ({"a": 2.0}, 2)] and Broken.closed
    assert caplog.text.count("metrics sink broken failed") == 1


def test_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rd = RunDir.create(tmp_path / "run")
    cfg = {"name": "wb", "algorithm": {"lr": 1e-6}}
    sink = make_sinks(rd, MonitorConfig(wandb=True, wandb_project="relax-test"), "trainer-0", cfg)
    assert [s.name for s in sink.sinks] == ["wandb"]  # type: ignore[attr-defined]
    run = sink.sinks[0].run  # type: ignore[attr-defined]
    assert run.name == "wb-trainer-0" and run.config["algorithm"] == {"lr": 1e-6}
    for step in range(1, 4):
        sink.log({"rollout/reward": 0.1 * step, "train/loss": 1.0 / step}, step=step)
    assert run.summary["rollout/reward"] == pytest.approx(0.2)  # W&B commits a step when the next one starts
    sink.close()  # ... and the last one at finish
    deadline = time.monotonic() + 60  # the W&B service process may still be flushing the offline file
    while True:
        offline = list(rd.wandb.glob("wandb/offline-run-*/run-*.wandb"))
        data = offline[0].read_bytes() if len(offline) == 1 else b""
        if (b"rollout/reward" in data and b"0.30000000000000004" in data) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(offline) == 1
    assert b"rollout/reward" in data and b"0.30000000000000004" in data and b"train/loss" in data
