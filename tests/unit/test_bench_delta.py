"""``relax-hpc bench snapshots --delta`` on an existing run dir's versions: the figures it prints are measured (delta
versions smaller than full ones, the changed fractions of the versions given), and bad options are one error line."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from relax_hpc.rundir import RunDir
from relax_hpc.weights import SnapshotPublisher
from tests.helpers.runutil import cli


def test_bench_delta_on_a_run_dir(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    pub = SnapshotPublisher(rd, keep_last=100)
    w = torch.randn(256, 128).bfloat16()
    for v in range(1, 5):
        pub.publish({"w": w.clone()}, version=v, step=v)
        w.view(-1)[:1024] += 1.0  # 1024 of 32768 elements (3.125 %) change per step
    pub.wait_housekeeping()
    p = cli("bench", "snapshots", "--delta", "--from", str(rd.root), "--gb", "0", "--dir",
            str(tmp_path), "--json", "--every-full", "4", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout)[f"run {rd.root}"]
    assert abs(res["changed_elements_median"] - 1024 / 32768) < 1e-9
    assert res["full"]["deltas"] == 0 and res["xor-zstd"]["deltas"] == 3 and res["sparse"]["deltas"] == 3
    assert res["xor-zstd"]["of_full"] < 0.5 and res["sparse"]["of_full"] < 0.5
    assert res["full"]["of_full"] == 1.0


def test_bench_delta_bad_options(tmp_path: Path) -> None:
    p = cli("bench", "snapshots", "--delta", "--dir", str(tmp_path / "nope"))
    assert p.returncode == 2 and p.stderr.strip().startswith("error:") and "Traceback" not in p.stderr


def test_amortised_bytes_per_version_with_a_full_base_every_k() -> None:
    from relax_hpc.bench.delta_model import amortised

    # full 100, deltas 2, 4, 6 bytes at distances 1, 2, 3 from their base
    am = amortised(100, [2, 4, 6])
    assert am == {1: 1.0, 2: 102 / 2 / 100, 3: 106 / 3 / 100, 4: 112 / 4 / 100}


def test_bench_delta_model_needs_a_model_folder(tmp_path: Path) -> None:
    p = cli("bench", "snapshots", "--delta", "--model", str(tmp_path), "--dir", str(tmp_path))
    assert p.returncode == 2 and p.stderr.strip().startswith("error:") and "config.json" in p.stderr
    assert "Traceback" not in p.stderr
