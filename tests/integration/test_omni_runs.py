"""Runs of the tiny Qwen2.5-VL recipe on generated PNG rows with the media processor pool (``data.media.pool_size``)
as real processes: colocate preempted with SIGTERM and resumed takes every prompt exactly once, in the order an
uninterrupted run takes them (the pool prefetches ahead; the checkpoint holds the position handed out); fully_async
workers preprocess through their own pools. Both report the rollout's wait for preprocessing
(``perf/preprocess_wait_time``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from relax_hpc.data.synthetic import write_task
from tests.helpers.runutil import REPO, cli, events, metrics, rewards, wait_exit

pytest.importorskip("av")
RECIPE = REPO / "recipes" / "tiny-vl-red-squares.yaml"
ROWS = 20


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    return write_task("red_squares", tmp_path_factory.mktemp("red"), rows=ROWS, seed=3)


def small(rows: Path, *extra: str) -> list[str]:
    sets = [f"data.path={rows}", "warmup.steps=0", "rollout.prompts_per_step=4", "rollout.batch_prompts=4",
            "rollout.n_samples=2", "rollout.sampling.max_new_tokens=4", "data.media.pool_size=1", *extra]
    return [a for s in sets for a in ("--set", s)]


def taken_prompts(run: Path) -> list[tuple[int, int]]:
    """(epoch, index) of every group in the run's shards."""
    from relax_hpc.store.shard_reader import read_shard

    out = []
    for shard in sorted((run / "samples" / "shards").glob("*/*.h5")):
        for s in read_shard(shard)[::2]:  # n_samples=2: one sample per group
            out.append((s.metadata["prompt"]["epoch"], s.metadata["prompt"]["index"]))
    return out


def expected_order(rows: Path, n: int) -> list[tuple[int, int]]:
    """The first ``n`` prompts an uninterrupted run of the recipe takes."""
    from relax_hpc.config.load import load_recipe
    from relax_hpc.models.load import load_tokenizer
    from relax_hpc.modes.components import build_prompt_stream

    cfg = load_recipe(RECIPE, overrides=[f"data.path={rows}"])
    stream = build_prompt_stream(cfg, load_tokenizer(cfg.model))
    return [(p.meta["epoch"], p.meta["index"]) for p in stream.next_batch(n, tensors=False)]


@pytest.mark.integration
@pytest.mark.slow
def test_colocate_with_the_pool_resumes_taking_each_prompt_once(rows, tmp_path):
    run = tmp_path / "run"
    steps = 20  # 80 prompts of 20: the run crosses epochs; long enough that the SIGTERM after step 3 lands before
    # the end on a faster machine too
    args = small(rows, f"num_steps={steps}", "store.retention=keep", "trainer.checkpoint_every=100")
    p = subprocess.run([sys.executable, "-m", "relax_hpc", "submit", str(RECIPE), "--executor", "local",
                        "--run-dir", str(run), "--detach", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    pid = json.loads((run / "launch.json").read_text())["procs"][0]["pid"]
    deadline = time.time() + 300
    while time.time() < deadline and not (
            (run / "logs/events/colocate-0.jsonl").exists() and len(rewards(run, "colocate-0")) >= 3):
        time.sleep(0.2)
    os.kill(pid, signal.SIGTERM)  # the pool has the next batches prefetched by now
    wait_exit(pid, 120)
    stopped = [e for e in events(run, "colocate-0") if e.get("event") == "preempted"]
    assert stopped and stopped[-1]["step"] < steps
    proc = cli("resume", str(run), "--wait", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ms = [r["metrics"] for r in metrics(run, "colocate-0") if "rollout/reward" in r["metrics"]]
    assert [r["step"] for r in metrics(run, "colocate-0") if "rollout/reward" in r["metrics"]] == \
        list(range(1, steps + 1))
    got = taken_prompts(run)
    want = expected_order(rows, 4 * steps)
    assert Counter(got) == Counter(want), (sorted(got), sorted(want))  # each prompt once, none skipped
    assert all("perf/preprocess_wait_time" in m and m["data/pool_restarts"] == 0 for m in ms)
    log = (run / "logs" / "colocate-0.log").read_text()
    assert log.count("1 media preprocessing workers") == 2  # the first run and the resumed one


@pytest.mark.integration
@pytest.mark.slow
def test_fully_async_workers_preprocess_through_their_pools(rows, tmp_path):
    run = tmp_path / "run"
    proc = cli("submit", str(RECIPE), "--executor", "local", "--run-dir", str(run),
               *small(rows, "mode=fully_async", "num_steps=3"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ms = [r["metrics"] for w in ("rollout-0", "rollout-1") for r in metrics(run, w) if "rollout/groups" in r["metrics"]]
    assert ms and all("perf/preprocess_wait_time" in m and "data/preprocess_wait_s" in m for m in ms)
    for w in ("rollout-0", "rollout-1"):  # each worker started its own pool
        assert "1 media preprocessing workers" in (run / "logs" / f"{w}.log").read_text()
    assert len(rewards(run, "trainer-0")) == 3


def _stored(run: Path) -> list:
    from relax_hpc.store.shard_reader import read_shard

    return [s for shard in sorted((run / "samples" / "shards").glob("*/*.h5")) for s in read_shard(shard)]


@pytest.mark.integration
@pytest.mark.slow
def test_qwen3_vl_videos_and_omni_audio_in_video_run(tmp_path):
    """Real colocate runs through the pool: a tiny Qwen3-VL on MP4 rows (timestamped frames), and a tiny
    Qwen2.5-Omni thinker with ``data.media.use_audio_in_video`` on MP4s with an AAC track (the video's audio is the
    sample's audio). The stored samples carry the tensors and the interleaved tokens."""
    import numpy as np

    from relax_hpc.data.video import write_video
    from relax_hpc.models.multimodal import build_tiny_bpe_tokenizer

    videos = write_task("moving_square", tmp_path / "ms", rows=8, seed=0)
    run = tmp_path / "q3"
    proc = cli("submit", str(RECIPE), "--executor", "local", "--run-dir", str(run),
               *small(videos, "model.tiny.arch=qwen3_vl", "num_steps=2", "store.retention=keep",
                      "reward.name=multiple_choice", "reward.kwargs={choices: AB}"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    tok = build_tiny_bpe_tokenizer()
    got = _stored(run)
    assert got and all("pixel_values_videos" in s.tensors and "video_grid_thw" in s.tensors for s in got)
    assert "seconds><|vision_start|>" in tok.decode(got[0].prompt_ids.tolist())

    d = tmp_path / "aiv"
    d.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(8):
        frames = np.repeat(np.repeat(rng.integers(0, 256, (8, 4, 4, 3), dtype=np.uint8), 8, 1), 8, 2)
        hz = float(rng.uniform(300, 1500))
        write_video(d / f"v{i}.mp4", frames, fps=4, audio=(0.4 * np.sin(2 * np.pi * hz * np.arange(44100) / 22050),
                                                           22050))
        rows.append({"prompt": "<video>Is the tone high? A) yes B) no", "answer": "A" if hz > 900 else "B",
                     "videos": [f"v{i}.mp4"]})
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "aiv-run"
    proc = cli("submit", str(REPO / "recipes" / "tiny-omni-tones.yaml"), "--executor", "local", "--run-dir",
               str(run), *small(d / "rows.jsonl", "num_steps=2", "store.retention=keep",
                                "data.media.use_audio_in_video=true", "data.max_prompt_tokens=512"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = _stored(run)
    assert got and all({"input_features", "pixel_values_videos"} <= set(s.tensors) for s in got)
    assert "<|vision_start|><|audio_bos|><|video_pad|>" in tok.decode(got[0].prompt_ids.tolist())
