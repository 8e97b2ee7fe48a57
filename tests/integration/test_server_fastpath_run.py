"""The server fast path wired through a real run: mode fully_async with ``rollout.engine: sglang`` and
``weights.transport: {kind: server}``. Trainer rank 0 (its own process) broadcasts every new version over gloo
into the rollout worker's server (``relax_hpc/weights/server_links.py``): the worker asks over the link's control
store, its engine calls ``/init_weights_update_group`` once and ``/update_weights_from_distributed`` per bucket.

The server is the SGLang stand-in (``tests/helpers/sglang_standin.py``, a real HTTP server process with a HF model
behind
SGLang 0.5.10's endpoints and its weight update group construction): SGLang cannot run on these machines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.runutil import DEMO, cli, events, metrics, rewards

pytestmark = [pytest.mark.integration]

STANDIN = Path(__file__).parents[1] / "helpers" / "sglang_standin.py"
SETS = ["mode=fully_async", "rollout.engine=sglang", "rollout.device=cpu", "rollout.num_workers=1",
        f"rollout.server.command={sys.executable} {STANDIN}", "weights.transport.kind=server",
        "rollout.server.sync_timeout_s=60", "model.tiny.tie_embeddings=false", "warmup.steps=2", "num_steps=12",
        "rollout.prompts_per_step=4", "rollout.batch_prompts=4", "rollout.n_samples=4"]


def test_fully_async_sglang_fast_path_broadcasts_each_version(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["submit", str(DEMO), "--executor", "local", "--run-dir", str(run)]
    for s in SETS:
        args += ["--set", s]
    proc = cli(*args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(rewards(run, "trainer-0")) == 12
    ms = [m["metrics"] for m in metrics(run, "rollout-0")]
    fast = [m for m in ms if m.get("weights/fast_path_used") == 1.0]
    assert len(fast) >= 3, f"{len(fast)} of {len(ms)} batches took their weights over the fast path"
    assert max(m["rollout/version"] for m in fast) > min(m["rollout/version"] for m in fast)
    assert max(m["rollout/server_fallbacks"] for m in ms) == 0
    assert not [e for e in events(run, "rollout-0") if e.get("event") == "weight_sync_fallback"]
    log = (run / "logs" / "server-rollout-0-0.log").read_text()
    assert log.count('"POST /init_weights_update_group HTTP/1.1" 200') == 1
    assert log.count('"POST /update_weights_from_distributed HTTP/1.1" 200') >= 3
    link = json.loads((run / "rendezvous" / "servers-0.json").read_text())
    assert link["backend"] == "gloo" and link["world_size"] == 2 and link["generation"] == 1
    assert json.loads((run / "STATUS.json").read_text())["state"] == "completed"
