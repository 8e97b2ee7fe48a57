"""Multi-turn episodes inside the real modes, with real processes: colocate and fully_async runs of the tiny
digit-lookup recipe write episode samples (own prompts, masked tool tokens, turns) and log the agent/* metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.runutil import REPO, cli, metrics

RECIPE = REPO / "recipes" / "tiny-digit-lookup-tool.yaml"
SMALL = ["--set", "warmup.steps=0", "--set", "rollout.prompts_per_step=4", "--set", "rollout.n_samples=4",
         "--set", "store.retention=keep"]  # plumbing, not learning: no warm-up


def _samples(run: Path) -> list:
    from relax_hpc.rundir import RunDir
    from relax_hpc.store.consumer import ConsumerGroup

    c = ConsumerGroup(RunDir.open(run), name="check")
    return c.read(c.plan_available(1, 10_000))


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["colocate", "fully_async"])
def test_episodes_run_in_the_modes(tmp_path: Path, mode: str) -> None:
    run = tmp_path / "run"
    extra = ["--set", "rollout.num_workers=1", "--set", "max_staleness=2"] if mode == "fully_async" else []
    proc = cli("submit", str(RECIPE), "--executor", "local", "--run-dir", str(run), "--set", "num_steps=3",
               "--set", f"mode={mode}", *SMALL, *extra, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "STATUS.json").read_text())["state"] == "completed"
    proc_name = "colocate-0" if mode == "colocate" else "rollout-0"
    m = [r["metrics"] for r in metrics(run, proc_name) if "agent/turns_per_episode" in r["metrics"]]
    assert m, "no agent/* metrics logged"
    assert all(x["agent/episodes"] % 4 == 0 and x["agent/episodes"] > 0 for x in m)  # whole groups of 4
    assert all(x["agent/turns_per_episode"] >= 1 for x in m)
    # the trainer's metrics carry them too (fully_async: from the episodes' samples it trained on), so the
    # monitor, which reads the trainer's metrics, shows them in both modes
    tname = "colocate-0" if mode == "colocate" else "trainer-0"
    tm = [r["metrics"] for r in metrics(run, tname) if "agent/turns_per_episode" in r["metrics"]]
    assert len(tm) == 3 and all(x["agent/episodes"] == 16 for x in tm)  # 4 prompts x 4 episodes per step
    snap = json.loads(cli("monitor", str(run), "--json").stdout)
    for key in ("turns", "tool_calls", "tool_errors", "tool_latency", "truncations", "episode_reward"):
        assert snap[key] is not None, key
    assert snap["turns"] >= 1
    samples = _samples(run)
    assert samples
    for s in samples:
        turns = s.turns  # the store's turn-boundary column
        assert turns is not None and turns.dtype == np.int32 and turns.shape[1] == 2 and len(turns)
        assert sum(b - a for a, b in turns.tolist()) == int(s.loss_mask.sum())
        assert all(s.loss_mask[a:b].all() for a, b in turns.tolist())
        assert len(s.response_ids) == len(s.loss_mask) == len(s.logprobs)
