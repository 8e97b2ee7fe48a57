"""``relax-hpc bench preprocess``: media preprocessing in the processor pool against inline, on the same rows.

Writes ``--rows`` synthetic rows into a scratch folder, each with one PNG image, one FLAC audio at 44.1 kHz
(resampled to 16 kHz) and one MP4 video (PyAV), then:

1. **throughput**: all rows' tensors made inline (``PromptStream.next_batch``) and through a pool of ``--workers``
   processes (``PrefetchingStream``), alternating order over ``--repeat`` rounds: samples/s of each and the ratio;
2. **rollout wait**: a rollout loop of ``--batches`` batches that generates ``--new-tokens`` tokens per prompt with a
   tiny Qwen2.5-VL model (real ``generate`` on the prompt's image and video tensors) after taking each batch: the
   seconds the loop spent waiting for preprocessing inline and with the pool (target: ~0 once the pool keeps up).

The pool's tensors are checked equal to the inline ones (bit for bit) on the first round.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.bench.common import ScratchDirs, machine, print_fields, report, run_guarded


def write_rows(folder: Path, n: int, *, image_px: int, audio_s: float, video_s: float, video_px: int) -> Path:
    from PIL import Image

    from relax_hpc.data.media import write_audio
    from relax_hpc.data.video import write_video

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        block = rng.integers(0, 256, (image_px // 16, image_px // 16, 3), dtype=np.uint8)
        Image.fromarray(np.repeat(np.repeat(block, 16, 0), 16, 1)).save(folder / f"im{i}.png")
        t = np.arange(int(audio_s * 44100)) / 44100
        write_audio(folder / f"a{i}.flac", 0.3 * np.sin(2 * np.pi * (220 + 20 * i) * t), 44100)
        small = rng.integers(0, 256, (int(video_s * 15), video_px // 16, video_px * 4 // 3 // 16, 3), dtype=np.uint8)
        write_video(folder / f"v{i}.mp4", np.repeat(np.repeat(small, 16, 1), 16, 2), fps=15)
        rows.append({"prompt": f"Describe item {i}.", "answer": str(i), "images": [f"im{i}.png"],
                     "audios": [f"a{i}.flac"], "videos": [f"v{i}.mp4"]})
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _preprocessor(tok: Any, *, image_max_px: int, video_max_px: int, fps: float) -> Any:
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from relax_hpc.data.video import VideoSettings
    from relax_hpc.models.multimodal import MultimodalPreprocessor

    return MultimodalPreprocessor(
        tok, image_processor=Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=image_max_px),
        feature_extractor=WhisperFeatureExtractor(feature_size=16, sampling_rate=16000, hop_length=160,
                                                  chunk_length=10, n_fft=400),
        video=VideoSettings(fps=fps, min_frames=2, max_frames=64, min_pixels=28 * 28, max_pixels=video_max_px))


def _drain(stream: Any, n: int, batch: int) -> list[Any]:
    out: list[Any] = []
    while len(out) < n:
        got = stream.next_batch(min(batch, n - len(out)))
        if not got:
            break
        out.extend(got)
    return out


def measure(args: argparse.Namespace, dirs: ScratchDirs) -> dict[str, Any]:
    import torch

    from relax_hpc.config.schema import DataConfig, TinyModelConfig
    from relax_hpc.data import PromptDataset, PromptStream
    from relax_hpc.data.pool import PrefetchingStream, ProcessorPool
    from relax_hpc.models.multimodal import build_tiny_bpe_tokenizer, build_tiny_vl_model

    torch.set_num_threads(args.threads)
    rows = write_rows(dirs.new("media"), args.rows, image_px=args.image_px, audio_s=args.audio_s,
                      video_s=args.video_s, video_px=args.video_px)
    tok = build_tiny_bpe_tokenizer()
    pre = _preprocessor(tok, image_max_px=args.image_max_pixels, video_max_px=args.video_max_pixels, fps=args.fps)
    ds = PromptDataset(DataConfig(path=str(rows), shuffle=False, num_epochs=10**6, max_prompt_tokens=1 << 20), tok,
                       0, multimodal=pre)
    t0 = time.perf_counter()
    pool = ProcessorPool(pre, args.workers)
    start_s = time.perf_counter() - t0
    try:
        inline_t, pool_t = [], []
        for r in range(args.repeat):
            for kind in (("inline", "pool") if r % 2 == 0 else ("pool", "inline")):
                t0 = time.perf_counter()
                if kind == "inline":
                    got = _drain(PromptStream(ds, num_epochs=1), len(ds), args.batch)
                    inline_t.append(time.perf_counter() - t0)
                    ref = got
                else:
                    ps = PrefetchingStream(PromptStream(ds, num_epochs=1), pool, prefetch_batches=args.prefetch)
                    got = _drain(ps, len(ds), args.batch)
                    ps.close()
                    pool_t.append(time.perf_counter() - t0)
                    pooled = got
            if r == 0:
                same = all(a.multimodal[k].tobytes() == b.multimodal[k].tobytes()
                           for a, b in zip(ref, pooled, strict=True) for k in a.multimodal)
                if not same:
                    raise RuntimeError("the pool's tensors differ from inline preprocessing")
        model = build_tiny_vl_model(TinyModelConfig(hidden_size=64, num_layers=2), tok, seed=0).eval()
        waits = {kind: _rollout_wait(kind, ds, pool, model, tok, args) for kind in ("inline", "pool")}
    finally:
        pool.close()
    n = len(ds)
    res: dict[str, Any] = {
        "benchmark": "preprocess", "rows": n, "workers": args.workers, "prefetch_batches": args.prefetch,
        "media": f"PNG {args.image_px}^2 + FLAC {args.audio_s:g} s 44.1 kHz + MP4 {args.video_s:g} s "
                 f"{args.video_px * 4 // 3}x{args.video_px} 15 fps (sampled {args.fps:g} fps)",
        "pool_start_s": start_s,
        "inline_samples_per_s": n / min(inline_t), "pool_samples_per_s": n / min(pool_t),
        "speedup": min(inline_t) / min(pool_t),
    }
    for kind, w in waits.items():
        res[f"rollout_wait_s_{kind}"] = w["wait_s"]
        res[f"rollout_generate_s_{kind}"] = w["generate_s"]
        res[f"rollout_wait_fraction_{kind}"] = w["wait_s"] / max(w["wait_s"] + w["generate_s"], 1e-9)
    res["rollout"] = (f"{args.batches} batches of {args.batch} prompts, {args.new_tokens} new tokens each, tiny "
                      "Qwen2.5-VL generate on the image+video tensors")
    res["machine"] = machine()
    return res


def _rollout_wait(kind: str, ds: Any, pool: Any, model: Any, tok: Any, args: argparse.Namespace) -> dict[str, float]:
    import torch

    from relax_hpc.data import PromptStream
    from relax_hpc.data.pool import PrefetchingStream

    base = PromptStream(ds)
    stream = base if kind == "inline" else PrefetchingStream(base, pool, prefetch_batches=args.prefetch)
    wait = gen = 0.0
    keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
    try:
        for _ in range(args.batches):
            t0 = time.perf_counter()
            batch = stream.next_batch(args.batch)
            t1 = time.perf_counter()
            wait += t1 - t0
            with torch.no_grad():
                for p in batch:
                    ids = torch.tensor([p.prompt_ids])
                    mm = {k: torch.from_numpy(p.multimodal[k]) for k in keys}
                    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                   min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                                   **mm)
            gen += time.perf_counter() - t1
    finally:
        if kind == "pool":
            stream.close()
    return {"wait_s": wait, "generate_s": gen}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="relax-hpc bench preprocess", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--workers", type=int, default=2, help="pool processes")
    p.add_argument("--prefetch", type=int, default=2, help="batches prepared ahead")
    p.add_argument("--batch", type=int, default=4, help="prompts per rollout batch")
    p.add_argument("--repeat", type=int, default=2, help="throughput rounds (the best is reported)")
    p.add_argument("--batches", type=int, default=6, help="rollout batches for the wait measurement")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--image-px", type=int, default=448, help="image side in pixels")
    p.add_argument("--image-max-pixels", type=int, default=28 * 28 * 64)
    p.add_argument("--audio-s", type=float, default=4.0)
    p.add_argument("--video-s", type=float, default=4.0)
    p.add_argument("--video-px", type=int, default=240, help="video height (width 4/3 of it)")
    p.add_argument("--video-max-pixels", type=int, default=28 * 28 * 16)
    p.add_argument("--fps", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the rollout process")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    if min(args.rows, args.workers, args.batch, args.batches, args.repeat) < 1:
        print("error: --rows, --workers, --batch, --batches and --repeat must be >= 1", file=sys.stderr)
        return 2
    dirs = ScratchDirs(args.out, keep=args.keep, prefix="relax-bench-preprocess-")
    res = run_guarded(lambda: measure(args, dirs), dirs)
    if isinstance(res, int):
        return res
    return report(res, dirs, as_json=args.json, text=print_fields)
