"""A fully_async worker with room for two batches (one worker, ``max_staleness: 2``) starts its next batch while the
batch in flight decodes its tail: the demo's tiny model with random weights (no warm-up, a learning rate too small to
move it) gives a long-tailed length mix. Every group the worker writes is trained once or dropped-and-counted, the
staleness stays within the bound, and the overlap happened."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.runutil import DEMO, cli, metrics


@pytest.mark.integration
def test_a_worker_with_room_overlaps_its_batches_and_each_group_is_trained_once(tmp_path: Path) -> None:
    from relax_hpc.store.audit import audit
    from relax_hpc.store.shard_reader import read_shard

    run = tmp_path / "run"
    proc = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), "--set", "mode=fully_async",
               "--set", "num_steps=6", "--set", "warmup.steps=0", "--set", "rollout.num_workers=1",
               "--set", "max_staleness=2", "--set", "rollout.prompts_per_step=8", "--set", "rollout.batch_prompts=8",
               "--set", "rollout.n_samples=4", "--set", "rollout.sampling.max_new_tokens=64",
               "--set", "model.tiny.max_position=128", "--set", "trainer.lr=1e-7", "--set", "store.retention=keep",
               timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    worker = [r["metrics"] for r in metrics(run, "rollout-0") if "rollout/groups" in r["metrics"]]
    assert sum(m["rollout/next_batch_started"] for m in worker) > 0  # batches overlapped
    assert all(0 < m["perf/decode_occupancy"] <= 1 for m in worker if "perf/decode_occupancy" in m)
    ids = [s.group_id for p in sorted((run / "samples" / "shards").glob("*/*.h5")) for s in read_shard(p)]
    assert len(set(ids)) * 4 == len(ids)  # every group written once, whole
    assert sum(m["rollout/groups"] for m in worker) == len(set(ids))
    trainer = [r["metrics"] for r in metrics(run, "trainer-0") if "rollout/staleness_max" in r["metrics"]]
    assert len(trainer) == 6 and max(m["rollout/staleness_max"] for m in trainer) <= 2
    assert sum(m["train/samples"] for m in trainer) == 6 * 8 * 4
    a = audit(run)  # the store's accounting: produced = consumed + dropped + unread, nothing lost or read twice
    assert a.balanced and a.produced_groups == len(set(ids)), a.to_json()
