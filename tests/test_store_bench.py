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
    ):
        assert out[key] > 0, key
    assert out["text_samples"] == 512 and out["large_samples"] == 8
    assert list(tmp_path.iterdir()) == []  # the temporary folder is removed
