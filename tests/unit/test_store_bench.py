"""The sample-store benchmark runs end to end on tiny sizes and reports every figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relax_hpc.bench.store import main


def test_bench_store_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--json",
        "--dir",
        str(tmp_path),
        "--text-samples",
        "512",
        "--text-shard",
        "64",
        "--large-samples",
        "8",
        "--large-shard",
        "4",
        "--large-mb",
        "0.5",
        "--repeat",
        "1",
        "--fastpath-rounds",
        "4",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "text_write_samples_per_s",
        "text_read_samples_per_s",
        "large_write_mb_per_s",
        "large_read_mb_per_s",
        "raw_write_mb_per_s",
        "raw_read_mb_per_s",
        "large_write_ratio",
        "large_read_ratio",
        "fastpath_demo_write_ms",
        "fastpath_demo_read_ms",
        "library_demo_write_ms",
        "library_real_read_ms",
    ):
        assert out[key] > 0, key
    assert out["text_samples"] == 512 and out["large_samples"] == 8
    assert list(tmp_path.iterdir()) == []  # the temporary folder is removed


def test_bench_store_writers_simulation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--json", "--dir", str(tmp_path), "--writers", "8,32", "--sim-steps", "8", "--sim-warmup", "2",
            "--sim-step-samples", "64", "--sim-shard-groups", "2", "--sim-commit-every", "2"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["runs"]
    assert [r["writers"] for r in rows] == [8, 32]
    for r in rows:
        assert r["steps"] == 6 and r["samples_per_step"] == 64 and r["plan_ms_p50"] > 0
        # consumed shards (and their announcements) are deleted at each commit: live files stay bounded by the
        # backlog, not the run's length; each live shard has one announcement, each writer one head file
        assert r["files_alive_end"] <= r["files_alive_max"] <= 2 * (4 * r["shards_per_step"] + 8) + r["writers"]
        # the first plan lists every writer folder, the others read the announcement index
        assert r["full_scans"] >= 1 and r["plans_from_index"] >= r["steps"]
        assert r["run_dir_entries_end"] >= r["writers"]  # one folder per writer identity
    assert out["plan_growth"] > 0 and isinstance(out["plan_ok"], bool)
