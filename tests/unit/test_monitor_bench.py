"""The monitor benchmark runs end to end (small sizes) and reports its figures."""

from __future__ import annotations

import json

import pytest

from relax_hpc.bench.monitor import main


def test_bench_monitor_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--roles", "6", "--lines", "600", "--rounds", "3", "--idle-s", "0.4", "--interval", "0.1",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["roles"] == 6 and r["metric_lines"] == 600 and r["refresh_rounds"] == 3
    assert 0 < r["refresh_median_s"] <= r["refresh_max_s"] < 5
    assert r["idle_refreshes"] >= 3 and 0 <= r["idle_cpu_fraction"] < 1.5


def test_bench_monitor_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--roles", "2", "--lines", "50", "--rounds", "1", "--idle-s", "0.1", "--interval", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "first read:" in out and "refresh:" in out and "idle live loop:" in out
