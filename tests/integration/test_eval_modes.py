"""Held-out evaluation during training in both modes (the demo's tiny model, real processes), and after the fact on
stored snapshots with ``relax-hpc eval``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.runutil import DEMO, cli, metrics

# reverse_digits of 5 digits: the training task makes 2-4 digits, so none of these is ever a training prompt
EVAL = ["--set", "eval.data.task.name=reverse_digits", "--set", "eval.data.task.min_len=5",
        "--set", "eval.data.task.max_len=5", "--set", "eval.data.task.num_prompts=12", "--set", "eval.every=3",
        "--set", "eval.n_samples=2", "--set", "eval.pass_k=[1,2]", "--set", "eval.sampling.temperature=1.0"]
SHORT = ["--set", "num_steps=6", "--set", "warmup.steps=4", "--set", "rollout.prompts_per_step=8",
         "--set", "trainer.checkpoint_every=100", "--set", "weights.keep_last=10"]


def _summaries(run: Path) -> dict[int, dict]:
    return {json.loads(p.read_text())["version"]: json.loads(p.read_text()) for p in (run / "eval").glob("v*.json")}


def _check_records(run: Path, versions: set[int], proc: str) -> None:
    got = _summaries(run)
    assert set(got) == versions, sorted(got)
    for v, rec in got.items():
        m = rec["metrics"]
        assert m["eval/prompts"] == 12 and m["eval/samples"] == 24
        assert 0.0 <= m["eval/pass@1"] <= m["eval/pass@2"] <= 1.0
        assert 0.0 <= m["eval/accuracy_thresholded"] <= m["eval/accuracy"] + 1e-9 <= 1.0 + 1e-9
        assert m["eval/response_length"] > 0
        lines = [json.loads(x) for x in (run / "eval" / f"v{v:06d}.samples.jsonl").read_text().splitlines()]
        assert len(lines) == 24 and {x["version"] for x in lines} == {v}
        assert m["eval/accuracy"] == pytest.approx(sum(x["reward"] for x in lines) / 24)
    logged = {r["step"]: r["metrics"] for r in metrics(run, proc) if "eval/accuracy" in r["metrics"]}
    assert set(logged) == versions
    for v in versions:
        assert logged[v]["eval/accuracy"] == pytest.approx(got[v]["metrics"]["eval/accuracy"])


@pytest.mark.integration
def test_eval_during_colocate_and_after_the_fact(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), *SHORT, *EVAL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_records(run, {0, 3, 6}, "colocate-0")
    step_metrics = [r["metrics"] for r in metrics(run, "colocate-0") if "train/loss" in r["metrics"]]
    assert len(step_metrics) == 6
    for m in step_metrics:  # the engine generates with the trainer's own module: float32 rounding only
        assert m["train/mismatch_kl"] < 1e-6 and m["train/logprob_abs_diff_max"] < 1e-2
    before = _summaries(run)
    # after the fact: the stored snapshots again (greedy this time), and the file of version 6 kept as it was
    out = cli("eval", str(run), "--snapshots", "v4,v5", "--executor", "local")
    assert out.returncode == 0, out.stderr[-3000:]
    after = _summaries(run)
    assert set(after) == {0, 3, 4, 5, 6} and after[6] == before[6]
    assert "v4" in out.stdout and "v5" in out.stdout
    again = cli("eval", str(run), "--snapshots", "all", "--executor", "local")  # evaluated ones are skipped
    assert again.returncode == 0, again.stderr[-3000:]
    assert "1 snapshot" in again.stdout or "v1" in again.stdout


@pytest.mark.integration
def test_eval_during_fully_async_on_a_rollout_worker(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), "--set", "mode=fully_async",
               "--set", "rollout.batch_prompts=4", *SHORT, *EVAL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _summaries(run)
    assert 0 in got and 6 in got, sorted(got)  # the first snapshot and the final one (when the run ended)
    assert {r["proc"] for r in got.values()} == {"rollout-0"}
    _check_records(run, set(got), "rollout-0")
    step_metrics = [r["metrics"] for r in metrics(run, "trainer-0") if "train/loss" in r["metrics"]]
    assert all("train/mismatch_kl" in m for m in step_metrics)


@pytest.mark.integration
def test_a_worker_that_starts_late_still_evaluates_the_base_model(tmp_path: Path) -> None:
    """fully_async: another worker may feed the trainer past version 0 before the evaluating worker's first batch;
    that worker loads snapshot 0 itself first (real snapshots of a finished run, the demo's engine, the receiver the
    worker builds)."""
    import asyncio

    from relax_hpc.eval.hook import EvalHook
    from relax_hpc.eval.offline import build_engine, run_config
    from relax_hpc.events import EventLog
    from relax_hpc.models.load import load_tokenizer
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights.transport import make_receiver

    run = tmp_path / "run"
    proc = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), *SHORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rd = RunDir(run)
    cfg = run_config(rd, [a for a in EVAL if a != "--set"])
    tok = load_tokenizer(cfg.model)
    events = EventLog(rd, "rollout", 0)
    loop = asyncio.new_event_loop()
    engine = build_engine(rd, cfg, tok, events.proc, events)
    try:
        worker_cfg = cfg.model_copy(update={"mode": "fully_async"})  # the snapshots of a colocate run, as a worker
        sync = make_receiver(worker_cfg, engine, run_dir=rd, rank=0, proc="rollout-0", events=events)
        assert sync.newest() == 6
        hook = EvalHook(rd, cfg, tok, engine=engine, run=loop.run_until_complete, events=events, proc="rollout-0")
        got = hook.at_start(sync)
        assert got is not None and engine.version == 0 and set(_summaries(run)) == {0}
        assert hook.at_start(sync) is None  # once
        assert hook.on_weights(loop.run_until_complete(sync.update(files_first=True))[0]) is not None
        assert engine.version == 6 and set(_summaries(run)) == {0, 6}
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
        events.close()
