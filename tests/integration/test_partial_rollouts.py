"""Partial rollouts in colocate (``rollout.partial``) end to end: the demo's tiny model with random weights (no
warm-up, a learning rate too small to move it) samples EOS about once in 18 tokens, so its responses are a
long-tailed length mix; each step starts 1.5x the groups it trains, aborts the tail and carries it over. A SIGTERM
mid-run checkpoints the carry buffer; the resume starts its prompts afresh. The audit: every prompt the data cursor
took was trained exactly once, or is in the final carry buffer, or was dropped for staleness (counted) -- by the
prompts' dataset positions stored with the samples."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.runutil import DEMO, cli, events, metrics, sigterm_when, submit_detached

STEPS = 8
ARGS = ["--set", f"num_steps={STEPS}", "--set", "warmup.steps=0", "--set", "rollout.prompts_per_step=8",
        "--set", "rollout.n_samples=4", "--set", "rollout.sampling.max_new_tokens=64",
        "--set", "model.tiny.max_position=128", "--set", "store.retention=keep",
        "--set", "trainer.checkpoint_every=50", "--set", "trainer.async_checkpoint=false", "--set", "trainer.lr=1e-7",
        "--set", 'rollout.partial={"overprovision": 1.5}']


def _carrying_after(run: Path, steps: int) -> Callable[[], bool]:
    """True once the colocate process logged ``steps`` steps with groups in its carry buffer."""
    def ready() -> bool:
        if not (run / "logs/events/colocate-0.jsonl").exists():
            return False
        ms = [r["metrics"] for r in metrics(run, "colocate-0") if "rollout/reward" in r["metrics"]]
        return len(ms) >= steps and ms[-1]["rollout/partial_carried_groups"] > 0
    return ready


def _trained_positions(run: Path) -> tuple[list[tuple[int, int]], int]:
    """(epoch, dataset index) of every group in the store, one entry per group; the samples stored."""
    from relax_hpc.store.shard_reader import read_shard

    groups: dict[str, tuple[int, int]] = {}
    samples = 0
    for path in sorted((run / "samples" / "shards").glob("*/*.h5")):
        for s in read_shard(path):
            samples += 1
            p = s.metadata["prompt"]
            assert groups.setdefault(s.group_id, (p["epoch"], p["index"])) == (p["epoch"], p["index"])
    return list(groups.values()), samples


def _data_order(run: Path) -> list[int]:
    """The dataset indices of epoch 0 in the order the run's prompt stream takes them."""
    from relax_hpc.config.load import validate_dict
    from relax_hpc.models.load import load_tokenizer
    from relax_hpc.modes.components import build_prompt_stream

    cfg = validate_dict(json.loads((run / "config.json").read_text()))
    return build_prompt_stream(cfg, load_tokenizer(cfg.model)).order(0)


@pytest.mark.integration
def test_partial_rollouts_train_each_prompt_once_across_carry_over_and_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    sigterm_when(submit_detached(DEMO, run, *ARGS), _carrying_after(run, 3), timeout_s=120)
    ev = [e for e in events(run, "colocate-0") if e.get("event") == "preempted"]
    assert ev, "no preempted event"
    stopped_at = ev[-1]["step"]
    assert stopped_at < STEPS
    state = json.loads((run / "checkpoints" / f"step_{stopped_at:08d}" / "state.json").read_text())
    carried = state["partial"]["prompts"]
    assert carried, "the checkpoint keeps no carried prompt: the resume path is not exercised"

    proc = cli("resume", str(run), "--wait", timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recs = [r for r in metrics(run, "colocate-0") if "rollout/reward" in r["metrics"]]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    ms = {r["step"]: r["metrics"] for r in recs}
    # the resumed step starts the checkpoint's carried groups afresh (no tokens of theirs were kept)
    assert ms[stopped_at + 1]["rollout/partial_restarted_groups"] == len(carried)
    assert ms[stopped_at + 1]["rollout/partial_continued_groups"] == 0
    assert sum(m["rollout/partial_aborted_samples"] for m in ms.values()) > 0  # the tail was cut ...
    assert sum(m["rollout/carried_tokens"] for m in ms.values()) > 0  # ... and carried into later steps
    assert all(m["rollout/carried_age_mean"] in (0.0, 1.0) for m in ms.values())  # max_staleness 1

    final = json.loads((run / "checkpoints" / f"step_{STEPS:08d}" / "state.json").read_text())
    taken = _data_order(run)[:final["data"]["index"]]
    assert final["data"]["epoch"] == 0
    buffer = [(e["epoch"], e["index"]) for e in final["partial"]["prompts"]]
    trained, stored = _trained_positions(run)
    dropped = sum(m["rollout/partial_dropped_groups"] for m in ms.values())
    assert len(trained) == len(set(trained)), "a prompt trained twice"
    assert not set(trained) & set(buffer), "a prompt both trained and still carried"
    assert set(trained) | set(buffer) <= {(0, i) for i in taken}, "a prompt trained that the cursor did not take"
    assert len(taken) == len(trained) + len(buffer) + dropped, (len(taken), len(trained), len(buffer), dropped)
    # every group written was trained, in the step that wrote it (none stale, none twice)
    assert sum(m["train/samples"] for m in ms.values()) == stored
    assert sum(m.get("rollout/stale_dropped", 0) for m in ms.values()) == 0
