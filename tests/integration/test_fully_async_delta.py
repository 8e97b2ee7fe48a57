"""Mode fully_async with delta snapshots on (``weights.delta``) and every version through the files: the trainer
publishes deltas of a full version, the rollout workers reconstruct them, and the run completes every step."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_hpc.rundir import RunDir
from relax_hpc.weights import load_snapshot
from relax_hpc.weights.manifest import complete_versions, read_manifest
from tests.helpers.runutil import DEMO, cli, metrics, rewards


@pytest.mark.integration
def test_fully_async_demo_with_delta_snapshots(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), "--set", "num_steps=8",
               "--set", "mode=fully_async", "--set", "warmup.steps=2", "--set", "rollout.prompts_per_step=4",
               "--set", "rollout.batch_prompts=4", "--set", "weights.transport={kind: files}",
               "--set", "weights.keep_last=100", "--set", "weights.delta={every_full: 4, max_fraction: 1.0}",
               "--set", "model.dtype=bfloat16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(rewards(run, "trainer-0")) == 8
    rd = RunDir.open(run)
    bases = {v: (read_manifest(rd.snapshot(v)).get("delta") or {}).get("base") for v in complete_versions(rd)}
    deltas = [v for v, b in bases.items() if b is not None]
    assert deltas and all(bases[b] is None and v - b < 4 for v, b in bases.items() if b is not None), bases
    for v in deltas:
        load_snapshot(rd.snapshot(v))  # every delta reconstructs (per-tensor sha256) from its base
    # the workers generated with versions that were published as deltas (they reconstructed them)
    used = {int(rec["metrics"]["rollout/version"]) for w in ("rollout-0", "rollout-1")
            for rec in metrics(run, w) if "rollout/version" in rec["metrics"]}
    assert used & set(deltas), (used, deltas)
