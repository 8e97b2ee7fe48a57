"""The monitor's headline numbers keep their labels whole on an 80-column terminal (they used to be cut:
"entro…"), and the plot's panels show only metrics that runs write."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console

from relax_hpc.monitor import view
from relax_hpc.monitor.plot import PANELS

ROOT = Path(__file__).resolve().parents[2]


def snapshot() -> dict:
    snap = {"step": 539, "total_steps": 800, "progress": 0.67, "eta_s": 1983.0, "weight_version": 539,
            "time": 100.0, "last_progress_time": 90.0, "name": "demo", "run_id": "demo-20261204-234708-7ec4c6",
            "mode": "colocate", "state": "running", "run_dir": "/tmp/a/rather/long/run/dir/demo-colocate",
            "reward_trend": -0.0025}
    for group in (*view.METRIC_ROWS, *view.OPTIONAL_ROWS):
        for _, key in group:
            snap[key] = -1.742e-09 if key == "loss" else 12345.678
    return snap


@pytest.mark.parametrize("width", [80, 60])
def test_metric_labels_are_not_cut(width: int) -> None:
    console = Console(width=width, record=True, color_system=None)
    console.print(view._header(snapshot()))
    text = console.export_text()
    assert "…" not in text, text
    flat = re.sub(r"[\s│]+", " ", text)
    for group in (*view.METRIC_ROWS, *view.OPTIONAL_ROWS):
        for label, _ in group:
            assert f"{label} " in flat, (label, text)
    assert all(len(line) <= width for line in text.splitlines())


def test_plot_panels_show_metrics_that_runs_write() -> None:
    """Every curve of the plot is a metric some role writes (the idle panel had a 'rollout' series nothing wrote)."""
    sources = "\n".join(p.read_text() for p in (ROOT / "relax_hpc").rglob("*.py")
                        if "monitor" not in p.parts and p.name != "monitor.py")
    for _, curves in PANELS:
        for name, _ in curves:
            assert f'"{name}"' in sources, f"the plot shows {name}, which no role writes"
