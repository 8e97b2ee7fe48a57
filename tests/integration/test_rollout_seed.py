"""fully_async runs are reproducible: a rollout worker's sampling and prompt stream come from the recipe seed and its
worker index (not the clock), so two runs with the same seed write the same first batch; another seed does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_hpc.rundir import RunDir
from tests.helpers.runutil import DEMO, cli

SHORT = ["--set", "mode=fully_async", "--set", "rollout.num_workers=1", "--set", "num_steps=2",
         "--set", "warmup.steps=0", "--set", "store.retention=keep", "--set", "rollout.prompts_per_step=4",
         "--set", "rollout.batch_prompts=4", "--set", "rollout.n_samples=4"]


def first_batch(run: Path) -> list[tuple[list[int], list[int]]]:
    """(prompt, response) of every sample of worker 0's first shard."""
    from relax_hpc.store import read_shard
    from relax_hpc.store.layout import list_shards, list_writers, store_paths

    rd = RunDir.open(run)
    writers = [w for w in list_writers(rd) if w.startswith("rollout-0.")]
    assert len(writers) == 1, writers
    ref = list_shards(rd, writers[0])[0]
    samples = read_shard(store_paths(rd).writer_folder(writers[0]) / ref.name)
    return [(s.prompt_ids.tolist(), s.response_ids.tolist()) for s in samples]


def submit(run: Path, seed: int) -> None:
    p = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), "--set", f"seed={seed}", *SHORT,
            timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.integration
def test_same_seed_same_first_batch(tmp_path: Path) -> None:
    submit(tmp_path / "a", 5)
    submit(tmp_path / "b", 5)
    submit(tmp_path / "c", 6)
    a, b, c = (first_batch(tmp_path / r) for r in "abc")
    assert len(a) == 16
    assert a == b, "two runs with the same seed generated different first batches"
    assert a != c
