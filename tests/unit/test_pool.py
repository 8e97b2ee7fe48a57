"""The media processor pool: real worker processes (spawn), tensors through shared memory, the same tensors as
inline preprocessing, prefetching in order with a resumable position, a worker killed mid-item (restarted, the item
retried once), media errors skipped and counted."""

from __future__ import annotations

import json
import logging
import os
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.config.schema import DataConfig
from relax_hpc.data import PromptDataset, PromptStream
from relax_hpc.data.media import write_audio
from relax_hpc.data.pool import Job, PrefetchingStream, ProcessorPool, pack_shared, unpack_shared
from relax_hpc.data.video import VideoSettings, write_video
from relax_hpc.models.multimodal import TINY_AUDIO, TINY_IMAGE, MultimodalPreprocessor, build_tiny_bpe_tokenizer

pytest.importorskip("torch")
pytest.importorskip("av")


class CrashingPreprocessor(MultimodalPreprocessor):
    """Kills its own process (``os._exit(3)``) on the video ``crash_always.mp4`` every time, and on ``crash_once.mp4``
    the first time (a marker file beside it records that it did)."""

    def tensors(self, images, audios, videos=None):
        for v in videos or []:
            marker = Path(v).with_suffix(".crashed")
            if Path(v).name == "crash_always.mp4" or (Path(v).name == "crash_once.mp4" and not marker.exists()):
                marker.touch()
                os._exit(3)
        return super().tensors(images, audios, videos)


def make_pre(tok, cls=MultimodalPreprocessor):
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return cls(tok, image_processor=Qwen2VLImageProcessorPil(**TINY_IMAGE),
               feature_extractor=WhisperFeatureExtractor(**TINY_AUDIO),
               video=VideoSettings(fps=2.0, min_frames=2, max_frames=8, min_pixels=28 * 28, max_pixels=28 * 28 * 16))


def frames(n: int, h: int, w: int, seed: int) -> np.ndarray:
    small = np.random.default_rng(seed).integers(0, 256, (n, h // 8, w // 8, 3), dtype=np.uint8)
    return np.repeat(np.repeat(small, 8, 1), 8, 2)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_bpe_tokenizer()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    from PIL import Image

    d = tmp_path_factory.mktemp("media")
    for i in range(3):
        Image.fromarray(frames(1, 48 + 8 * i, 64, i)[0]).save(d / f"im{i}.png")
        write_audio(d / f"a{i}.flac", 0.4 * np.sin(np.arange(8000 + 2000 * i) * 0.05 * (i + 1)), 16000)
        write_video(d / f"v{i}.mp4", frames(6 + 2 * i, 56, 56 + 8 * i, i), fps=4)
    write_video(d / "crash_once.mp4", frames(4, 56, 56, 9), fps=4)
    write_video(d / "crash_always.mp4", frames(4, 56, 56, 9), fps=4)
    (d / "broken.flac").write_bytes(b"fLaC" + b"\x00" * 30)
    return d


@pytest.fixture(scope="module")
def pool(tok):
    """One pool of two workers for the module (worker start-up is seconds on a busy machine)."""
    with ProcessorPool(make_pre(tok, CrashingPreprocessor), 2) as p:
        yield p


def dataset(tok, d: Path, rows: list[dict], pre) -> PromptDataset:
    path = d / f"rows{abs(hash(json.dumps(rows))) % 10**8}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PromptDataset(DataConfig(path=str(path), shuffle=False, num_epochs=1), tok, 0, multimodal=pre)


MIXED = [{"prompt": f"q{i}", "answer": i, "images": [f"im{i % 3}.png"], "audios": [f"a{(i + 1) % 3}.flac"],
          "videos": [f"v{(i + 2) % 3}.mp4"]} for i in range(6)] + [{"prompt": "text only", "answer": 0}]


def test_shared_memory_round_trip_is_bit_identical_and_freed():
    rng = np.random.default_rng(0)
    arrays = {"f32": rng.standard_normal((7, 5)).astype(np.float32), "i64": np.arange(9, dtype=np.int64),
              "u8": rng.integers(0, 256, (3, 4, 5), dtype=np.uint8),
              "bf16_bits": rng.integers(0, 2**16, 11, dtype=np.uint16), "empty": np.zeros((0, 3), np.float32)}
    arrays["f32"][0, 0] = np.nan
    name, layout = pack_shared(arrays)
    back = unpack_shared(name, layout)
    for k, a in arrays.items():
        assert back[k].dtype == a.dtype and back[k].shape == a.shape and back[k].tobytes() == a.tobytes()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)


def test_pool_tensors_equal_inline_and_keep_order(tok, media_dir, pool):
    ds = dataset(tok, media_dir, MIXED, make_pre(tok))
    inline = [ds[i] for i in range(len(ds))]
    stream = PrefetchingStream(PromptStream(ds), pool, prefetch_batches=2)
    try:
        got = stream.next_batch(3) + stream.next_batch(3)
        assert stream.state() == {"epoch": 0, "index": 6, "num_prompts": 7}  # handed out, not prefetched
        got += stream.next_batch(3)
    finally:
        stream.close()
    assert [p.meta["index"] for p in got] == list(range(7))
    for a, b in zip(inline, got, strict=True):
        assert a.prompt_ids == b.prompt_ids
        if a.multimodal is None:
            assert b.multimodal is None
            continue
        assert set(a.multimodal) == set(b.multimodal)
        for k in a.multimodal:
            assert a.multimodal[k].dtype == b.multimodal[k].dtype
            assert a.multimodal[k].tobytes() == b.multimodal[k].tobytes(), k
    assert stream.exhausted and stream.stats()["data/media_skipped"] == 0


def test_a_crashed_worker_is_restarted_and_its_item_retried_once(tok, media_dir, pool, caplog):
    rows = [{"prompt": "a", "answer": 1, "videos": ["v0.mp4"]},
            {"prompt": "b", "answer": 2, "videos": ["crash_once.mp4"]},
            {"prompt": "c", "answer": 3, "videos": ["v1.mp4"]}, {"prompt": "d", "answer": 4, "audios": ["a0.flac"]}]
    ds = dataset(tok, media_dir, rows, make_pre(tok))
    restarts = pool.restarts
    with caplog.at_level(logging.WARNING):
        stream = PrefetchingStream(PromptStream(ds), pool)
        try:
            got = stream.next_batch(4)
        finally:
            stream.close()
    assert pool.restarts == restarts + 1 and (media_dir / "crash_once.crashed").exists()
    assert [p.answer for p in got] == [1, 2, 3, 4]  # the crashed item came back on its retry
    assert got[1].multimodal["video_grid_thw"].tolist() == ds[1].multimodal["video_grid_thw"].tolist()
    assert sum("died (exit code 3) on item" in r.getMessage() for r in caplog.records) == 1


def test_an_item_that_kills_its_worker_twice_and_media_errors_are_skipped(tok, media_dir, pool, caplog):
    rows = [{"prompt": "a", "answer": 1, "videos": ["crash_always.mp4"]},
            {"prompt": "b", "answer": 2, "audios": ["a1.flac"]}, {"prompt": "c", "answer": 3, "images": ["im1.png"]}]
    ds = dataset(tok, media_dir, rows, make_pre(tok))
    restarts = pool.restarts
    (media_dir / "a1.flac").rename(media_dir / "a1.keep")  # breaks after loading: the worker gets a MediaError
    try:
        with caplog.at_level(logging.WARNING):
            stream = PrefetchingStream(PromptStream(ds), pool)
            try:
                got = stream.next_batch(3)
            finally:
                stream.close()
        assert pool.restarts == restarts + 2
    finally:
        (media_dir / "a1.keep").rename(media_dir / "a1.flac")
    assert [p.answer for p in got] == [3]
    assert stream.num_media_skipped == 2 and stream.exhausted
    skipped = [r.getMessage() for r in caplog.records if "skipped prompt" in r.getMessage()]
    assert len(skipped) == 2 and "died twice" in skipped[0] and "a1.flac" in skipped[1]
    assert all("\n" not in m for m in skipped)


def test_pool_job_api_returns_errors_as_results(media_dir, pool):
    pool.submit(Job(1, [media_dir / "im0.png"], [], []))
    pool.submit(Job(2, [], [media_dir / "broken.flac"], []))
    res = {r.key: r for r in (pool.get(timeout=60), pool.get(timeout=60))}
    assert pool.get(timeout=0.2) is None and pool.pending == 0
    assert res[1].tensors["image_grid_thw"].tolist() == [[1, 4, 4]] and res[1].counts[0] == [4]
    assert res[2].tensors is None and "broken.flac" in res[2].error


def test_load_state_resumes_exactly_once_with_prefetched_prompts_dropped(tok, media_dir, pool):
    """A checkpoint taken while the pool has prompts prefetched: a new stream loaded from it (and the same stream
    moved back with ``load_state``) takes exactly the prompts an uninterrupted stream takes, each once, with the
    same tensors."""
    ds = dataset(tok, media_dir, MIXED, make_pre(tok))
    uninterrupted = [p.meta["index"] for p in PromptStream(ds, num_epochs=2).next_batch(14)]
    first = PrefetchingStream(PromptStream(ds, num_epochs=2), pool, prefetch_batches=2)
    try:
        taken = first.next_batch(2) + first.next_batch(3)
        saved = first.state()
        assert saved == {"epoch": 0, "index": 5, "num_prompts": 7}
        got = first.next_batch(2)  # the pump has more than these prefetched by now
        first.load_state(saved)  # back to the checkpoint: the prefetched slots and their results are dropped
        again = first.next_batch(2)
        assert [p.meta["index"] for p in again] == [p.meta["index"] for p in got]
        for a, b in zip(got, again, strict=True):
            assert a.multimodal is None or all(a.multimodal[k].tobytes() == b.multimodal[k].tobytes()
                                               for k in a.multimodal)
    finally:
        first.close()
    resumed = PrefetchingStream(PromptStream(ds, num_epochs=2), pool, prefetch_batches=2)
    try:
        resumed.load_state(saved)
        rest = []
        while batch := resumed.next_batch(4):
            rest += batch
    finally:
        resumed.close()
    order = [p.meta["index"] for p in taken + rest]
    assert order == uninterrupted and resumed.exhausted
    assert all(p.multimodal is not None for p in rest if p.meta["index"] != 6)
