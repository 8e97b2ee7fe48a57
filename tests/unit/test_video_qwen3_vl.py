"""Qwen3-VL video frames (``VideoSettings(style="qwen3_vl")``) computed as transformers' ``Qwen3VLVideoProcessor``
does. The processor itself cannot run here (its resize and RGB conversion call torchvision, which does not import
beside this torch), so each step is checked against the processor's own code that runs without torchvision: its
``sample_frames`` (frame indices), its module's ``smart_resize`` (frame size within the total pixel budget), its
``patchify`` (the patch layout of ``pixel_values_videos``, on our resized and normalised frames) and the processor's
``_calculate_timestamps`` (the ``<t seconds>`` of each temporal patch); plus fixed expected tensors."""

from __future__ import annotations

import numpy as np
import pytest

from relax_hpc.data.video import (
    VideoMeta,
    VideoSettings,
    frame_size,
    frames_to_patches,
    grid,
    probe,
    sample_indices,
    timestamps,
    video_tensors,
    write_video,
)

torch = pytest.importorskip("torch")
pytest.importorskip("av")

HALF = (0.5, 0.5, 0.5)
Q3 = VideoSettings(style="qwen3_vl", fps=2.0, min_frames=4, max_frames=768, patch_size=16, merge_size=2,
                   temporal_patch_size=2, min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 64, image_mean=HALF,
                   image_std=HALF)


def hf_processor():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(size={"shortest_edge": Q3.min_pixels, "longest_edge": Q3.max_pixels},
                                 min_frames=Q3.min_frames, max_frames=Q3.max_frames, fps=Q3.fps)


@pytest.mark.parametrize(("total", "fps"), [(12, 4.0), (10, 5.0), (300, 30.0), (3, 30.0), (7, 2.0), (2000, 25.0)])
def test_frame_indices_equal_the_hf_sampler(total, fps):
    from transformers.video_utils import VideoMetadata

    meta = VideoMeta(total, fps, 56, 64)
    hf = hf_processor().sample_frames(VideoMetadata(total_num_frames=total, fps=fps, width=64, height=56))
    np.testing.assert_array_equal(sample_indices(meta, Q3), hf)


def test_fixed_indices_and_timestamps():
    # 12 frames at 4 fps = 3 s -> int(3 * 2) = 6 frames at linspace(0, 11, 6).round()
    idx = sample_indices(VideoMeta(12, 4.0, 56, 64), Q3)
    assert idx.tolist() == [0, 2, 4, 7, 9, 11]
    assert timestamps(idx, 4.0, 2) == [0.25, 1.375, 2.5]
    # 3 frames: min_frames 4 capped by the video; the odd last patch repeats its frame
    idx3 = sample_indices(VideoMeta(3, 30.0, 56, 64), Q3)
    assert idx3.tolist() == [0, 1, 2]
    assert timestamps(idx3, 30.0, 2) == pytest.approx([1 / 60, 2 / 30])


def test_timestamps_equal_the_hf_processor():
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    for total, fps in ((12, 4.0), (3, 30.0), (301, 29.97)):
        idx = sample_indices(VideoMeta(total, fps, 56, 64), Q3)
        hf = Qwen3VLProcessor._calculate_timestamps(SimpleNamespace(), idx, fps, 2)
        assert timestamps(idx, fps, 2) == pytest.approx(hf, rel=0, abs=1e-12)


@pytest.mark.parametrize(("n", "h", "w"), [(6, 56, 64), (2, 480, 640), (40, 480, 640), (4, 20, 300), (8, 33, 47)])
def test_frame_size_equals_the_hf_smart_resize(n, h, w):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    want = smart_resize(num_frames=n, height=h, width=w, temporal_factor=2, factor=32, min_pixels=Q3.min_pixels,
                        max_pixels=Q3.max_pixels)
    assert frame_size(n, h, w, Q3) == want
    # the budget is for all frames together: more frames, smaller frames (Qwen2-VL's is per frame)
    if (h, w) == (480, 640):
        assert frame_size(40, h, w, Q3)[0] < frame_size(2, h, w, Q3)[0]


def test_patches_equal_the_hf_patchify(tmp_path):
    rng = np.random.default_rng(0)
    frames = np.repeat(np.repeat(rng.integers(0, 256, (12, 7, 8, 3), dtype=np.uint8), 8, 1), 8, 2)  # 56 x 64
    write_video(tmp_path / "v.mp4", frames, fps=4)
    out = video_tensors([tmp_path / "v.mp4"], Q3)
    meta = probe(tmp_path / "v.mp4")
    idx = sample_indices(meta, Q3)
    rh, rw = frame_size(len(idx), 56, 64, Q3)
    assert (rh, rw) == (64, 64) and grid(meta, Q3) == (3, 4, 4)
    assert out["video_grid_thw"].tolist() == [[3, 4, 4]]
    assert out["pixel_values_videos"].shape == (3 * 4 * 4, 3 * 2 * 16 * 16)
    # the same frames resized and normalised as ours do, then laid out by the HF processor's own patchify
    from relax_hpc.data.video import decode_frames

    x = torch.from_numpy(decode_frames(tmp_path / "v.mp4", idx)).permute(0, 3, 1, 2).float()
    x = torch.nn.functional.interpolate(x, size=(rh, rw), mode="bicubic", align_corners=False, antialias=True)
    x = (x.clamp(0, 255).round() - 127.5) / 127.5
    hf, t, gh, gw = hf_processor().patchify(x[None], patch_size=16, merge_size=2, temporal_patch_size=2)
    assert (t, gh, gw) == (3, 4, 4)
    np.testing.assert_allclose(out["pixel_values_videos"], hf[0].numpy(), rtol=0, atol=1e-6)
    # and frames_to_patches is what video_tensors used
    p2, g2 = frames_to_patches(decode_frames(tmp_path / "v.mp4", idx), Q3)
    assert g2 == (3, 4, 4)
    np.testing.assert_array_equal(p2, out["pixel_values_videos"])


# ------------------------------------------------------------------------------------------ a tiny Qwen3-VL
def hf_video_text(grid_thw, idx, fps) -> str:
    """What the HF Qwen3-VL processor puts in place of ``<|video_pad|>`` (its own ``replace_video_token``, called
    on a stand-in holding its token names: the full processor needs torchvision)."""
    import functools
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    fake = SimpleNamespace(vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
                           video_token="<|video_pad|>",
                           video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2))
    fake._calculate_timestamps = functools.partial(Qwen3VLProcessor._calculate_timestamps, fake)
    meta = VideoMetadata(total_num_frames=int(idx[-1]) + 1, fps=fps, frames_indices=np.asarray(idx))
    return Qwen3VLProcessor.replace_video_token(fake, {"video_grid_thw": np.asarray(grid_thw)[None],
                                                       "video_metadata": [meta]}, 0)


def test_tiny_qwen3_vl_video_prompts_and_packed_positions(tmp_path):
    import json

    from relax_hpc.config.schema import DataConfig, TinyModelConfig
    from relax_hpc.data import PromptDataset
    from relax_hpc.models.mrope import MRope
    from relax_hpc.models.multimodal import (
        build_tiny_bpe_tokenizer,
        build_tiny_multimodal_model,
        tiny_preprocessor,
    )
    from relax_hpc.trainer.batch import TrainItem, pack, response_logits

    rng = np.random.default_rng(2)
    for name, n, fps in (("a.mp4", 12, 4), ("b.mp4", 10, 5)):
        small = rng.integers(0, 256, (n, 6, 8, 3), dtype=np.uint8)
        write_video(tmp_path / name, np.repeat(np.repeat(small, 8, 1), 8, 2), fps=fps)  # 48 x 64
    rows = [{"prompt": "<video>What moves?", "answer": "A", "videos": ["a.mp4"]},
            {"prompt": "Compare <video> and <video>.", "answer": "B", "videos": ["b.mp4", "a.mp4"]},
            {"prompt": "Just text.", "answer": "C"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = build_tiny_bpe_tokenizer()
    pre = tiny_preprocessor("qwen3_vl", tok)
    ds = PromptDataset(DataConfig(path=str(tmp_path / "rows.jsonl"), max_prompt_tokens=4096, shuffle=False), tok,
                       seed=0, multimodal=pre)
    ps = [ds[i] for i in range(3)]
    # the prompt's video: what the HF processor writes, with the tensors' grid and the frames' timestamps
    idx = sample_indices(probe(tmp_path / "a.mp4"), pre.video)
    want = ("<|im_start|>user\n<|vision_start|>" + hf_video_text(ps[0].multimodal["video_grid_thw"][0], idx, 4.0) +
            "<|vision_end|>What moves?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(ps[0].prompt_ids) == want
    assert ps[0].prompt_ids == tok(want, add_special_tokens=False)["input_ids"]
    assert "<0.2 seconds>" in want and ps[1].multimodal["video_grid_thw"].shape == (2, 3)
    # server engines get one placeholder per video
    vid = tok.convert_tokens_to_ids("<|video_pad|>")
    assert [ps[k].engine_prompt_ids.count(vid) for k in (0, 1)] == [1, 2]
    # packed micro-batches: each sample's positions as the model computes them for it alone
    model = build_tiny_multimodal_model(TinyModelConfig(arch="qwen3_vl"), tok, seed=0).eval()
    rope = MRope.of(model)
    assert rope is not None and rope.family == "vl"
    items = [TrainItem.of(prompt_ids=np.asarray(p.prompt_ids), response_ids=np.arange(30, 35),
                       logprobs=np.zeros(5, np.float32), loss_mask=np.ones(5), tensors=p.multimodal or {})
             for p in ps]
    with torch.no_grad():
        ref = []
        for it in items:
            ids = torch.from_numpy(np.concatenate([it.sample.prompt_ids, it.sample.response_ids])).long()[None]
            mm = it.sample.tensors
            kw = rope.model_kwargs([{k: torch.from_numpy(v) for k, v in mm.items()}]) if mm else {}
            types = torch.zeros_like(ids, dtype=torch.int32)
            types[ids == vid] = 2
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                        use_cache=False, **kw).logits[0]
            p = len(it.sample.prompt_ids)
            ref.append(out[p - 1:p - 1 + 5])
        for rows_ in (False, True):
            mb = pack(items, 10**6, rows=rows_, pack_multimodal=True)[0]
            got = response_logits(model, mb)
            for s_, it in enumerate(mb.items):
                k = next(j for j, x in enumerate(items) if x is it)
                torch.testing.assert_close(got[mb.seq_ids == s_], ref[k], rtol=1e-4, atol=1e-4)
