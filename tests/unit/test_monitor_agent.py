"""The monitor shows its optional rows when a run reports them: multi-turn episode metrics (``agent/*``) and partial
rollouts (``rollout/carried_*``, ``rollout/partial_*``)."""

from __future__ import annotations

from pathlib import Path

from relax_hpc.envs.episode import EpisodeStats
from relax_hpc.envs.metrics import episode_metrics
from relax_hpc.monitor.state import RunMonitor
from tests.helpers.monitorrun import make_run, role_process, trainer_metrics


def test_agent_metrics_in_snapshot_and_view(tmp_path: Path) -> None:
    from rich.console import Console

    from relax_hpc.monitor.view import run_view

    stats = [EpisodeStats(turns=3, tool_calls=2, tool_errors=1, tool_latency_s=0.5, reward=1.0),
             EpisodeStats(turns=1, reward=0.0, truncated="max_turns")]
    agent = episode_metrics(stats)
    assert agent["agent/turns_per_episode"] == 2.0 and agent["agent/tool_calls_per_turn"] == 0.5
    assert agent["agent/tool_latency_s"] == 0.25 and agent["agent/truncated_episodes"] == 1.0
    rd = make_run(tmp_path / "run", steps=0)
    role_process(rd, role="trainer", rank=0, metrics=[[1, {**trainer_metrics(1), **agent}]], step=1)
    snap = RunMonitor(rd).refresh()
    assert snap["turns"] == 2.0 and snap["tool_errors"] == 1.0 and snap["truncations"] == 1.0
    console = Console(width=160, record=True)
    console.print(run_view(snap))
    text = console.export_text()
    assert "turns/ep" in text and "calls/turn" in text and "tool errs" in text
    # a single-turn run shows no agent row
    rd2 = make_run(tmp_path / "run2", steps=0)
    role_process(rd2, role="trainer", rank=0, metrics=[[1, trainer_metrics(1)]], step=1)
    console = Console(width=160, record=True)
    console.print(run_view(RunMonitor(rd2).refresh()))
    assert "turns/ep" not in console.export_text()


def test_partial_rollout_metrics_in_snapshot_and_view(tmp_path: Path) -> None:
    import numpy as np
    from rich.console import Console

    from relax_hpc.monitor.view import run_view
    from relax_hpc.record import Sample
    from relax_hpc.rollout.partial import carry_metrics

    carried = carry_metrics([Sample(response_ids=np.ones(3, np.int32), versions=np.array([4, 5, 5], np.int32))], 5)
    partial = {**carried, "rollout/partial_carried_groups": 3.0, "rollout/partial_aborted_samples": 9.0,
               "rollout/partial_dropped_groups": 1.0}
    rd = make_run(tmp_path / "run", steps=0)
    role_process(rd, role="trainer", rank=0, metrics=[[1, {**trainer_metrics(1), **partial}]], step=1)
    snap = RunMonitor(rd).refresh()
    assert snap["carried_tokens"] == 1.0 and snap["carried_age"] == 1.0 and snap["partial_dropped"] == 1.0
    console = Console(width=160, record=True)
    console.print(run_view(snap))
    text = console.export_text()
    assert "carried tok" in text and "carried age" in text and "turns/ep" not in text
    rd2 = make_run(tmp_path / "run2", steps=0)  # a run without partial rollouts shows no such row
    role_process(rd2, role="trainer", rank=0, metrics=[[1, trainer_metrics(1)]], step=1)
    console = Console(width=160, record=True)
    console.print(run_view(RunMonitor(rd2).refresh()))
    assert "carried tok" not in console.export_text()
