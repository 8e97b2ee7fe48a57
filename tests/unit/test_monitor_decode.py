"""The monitor shows the response-length percentiles and the decode-step occupancy: the trainer's own (colocate), or
the mean of the rollout workers' latest values (fully_async), whose other metrics lines it still skips unparsed."""

from __future__ import annotations

from pathlib import Path

from relax_hpc.monitor.state import RunMonitor
from tests.helpers.monitorrun import make_run, role_process, trainer_metrics


def test_decode_occupancy_of_the_rollout_workers_and_length_percentiles(tmp_path: Path) -> None:
    from rich.console import Console

    from relax_hpc.monitor.view import run_view

    rd = make_run(tmp_path / "run", steps=0)
    lengths = {"rollout/response_length_p50": 300.0, "rollout/response_length_p99": 3900.0,
               "rollout/response_length_max": 4096.0}
    role_process(rd, role="trainer", rank=0, metrics=[[2, {**trainer_metrics(2), **lengths}]], step=2)
    worker = {"rollout/generate_time": 1.0, "rollout/version": 1.0}
    for rank, occ in ((0, 0.9), (1, 0.7)):
        decode = {"perf/decode_occupancy": occ, "perf/decode_low_occupancy_time": 0.5, "perf/decode_time": 4.0}
        role_process(rd, role="rollout", rank=rank, metrics=[[1, {**worker, "perf/decode_occupancy": 0.1}],
                                                             [2, {**worker, **decode}], [3, worker]], step=3)
    mon = RunMonitor(rd)
    snap = mon.refresh()
    assert snap["response_p50"] == 300.0 and snap["response_p99"] == 3900.0 and snap["response_max"] == 4096.0
    assert abs(snap["decode_occupancy"] - 0.8) < 1e-9  # the latest value of each worker, averaged
    assert snap["decode_low_occupancy_time"] == 0.5
    assert sum(t.skipped for t in mon._events.tails.values()) == 2, "worker lines without decode metrics skipped"
    console = Console(width=160, record=True)
    console.print(run_view(snap))
    text = console.export_text()
    assert "decode occ" in text and "0.8" in text and "resp p99" in text and "3,900" in text


def test_the_trainers_own_decode_occupancy_comes_first(tmp_path: Path) -> None:
    rd = make_run(tmp_path / "run", steps=0)
    role_process(rd, role="trainer", rank=0, metrics=[[1, {**trainer_metrics(1), "perf/decode_occupancy": 0.25}]],
                 step=1)
    role_process(rd, role="rollout", rank=0, metrics=[[1, {"perf/decode_occupancy": 0.9}]], step=1)
    snap = RunMonitor(rd).refresh()
    assert snap["decode_occupancy"] == 0.25 and snap["response_p99"] is None
