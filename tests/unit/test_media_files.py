"""Real media files made here (WAV/FLAC/OGG/MP3 with libsndfile, AAC/M4A and MP4 with PyAV, PNG/JPEG with PIL):
decoding, resampling, video frames -> patches as the Qwen2-VL video processor computes them, and bad media skipped and
counted while the data goes on."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.config.schema import DataConfig
from relax_hpc.data import PromptDataset, PromptStream
from relax_hpc.data.media import MediaError, load_audio, write_audio
from relax_hpc.data.video import (
    VideoMeta,
    VideoSettings,
    decode_frames,
    frames_to_patches,
    probe,
    sample_indices,
    smart_resize,
    video_tensors,
    write_video,
)
from relax_hpc.models.multimodal import TINY_AUDIO, MultimodalPreprocessor, build_tiny_bpe_tokenizer

torch = pytest.importorskip("torch")
av = pytest.importorskip("av")

TINY_VIDEO = VideoSettings(fps=2.0, min_frames=2, max_frames=8, min_pixels=28 * 28, max_pixels=28 * 28 * 16)


def tone(seconds: float, rate: int, freq: float = 440.0) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * freq * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def blocky_frames(n: int, h: int, w: int, seed: int = 0) -> np.ndarray:
    """Frames of 8x8 single-colour blocks (codec-friendly: lossless luma and nearly lossless chroma)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (n, -(-h // 8), -(-w // 8), 3), dtype=np.uint8)
    return np.repeat(np.repeat(small, 8, 1), 8, 2)[:, :h, :w]


def write_m4a(path: Path, x: np.ndarray, rate: int) -> None:
    with av.open(str(path), "w") as c:
        st = c.add_stream("aac", rate=rate)
        st.layout = "mono"
        frame = av.AudioFrame.from_ndarray(x[None, :].astype(np.float32), format="flt", layout="mono")
        frame.sample_rate = rate
        resampler = av.AudioResampler(format="fltp", layout="mono", rate=rate)
        for f in resampler.resample(frame):
            for pkt in st.encode(f):
                c.mux(pkt)
        for pkt in st.encode(None):
            c.mux(pkt)


# ------------------------------------------------------------------------------------------------ audio
@pytest.mark.parametrize("suffix", [".wav", ".flac", ".ogg", ".mp3", ".m4a"])
def test_audio_files_decode_and_resample(tmp_path, suffix):
    x = tone(1.0, 22050)
    path = tmp_path / f"a{suffix}"
    write_m4a(path, x, 22050) if suffix == ".m4a" else write_audio(path, x, 22050)
    y = load_audio(path, 16000)
    assert y.dtype == np.float32
    lossless = suffix in (".wav", ".flac")
    # lossy codecs add encoder delay/padding (a few ms); lossless files keep the exact length
    assert abs(y.size - 16000) <= (0 if lossless else 2000)
    ref = tone(1.0, 16000)
    # the 440 Hz tone survives: its spectral peak sits at 440 Hz, its level at 0.5
    spec = np.abs(np.fft.rfft(y[:16000] if y.size >= 16000 else np.pad(y, (0, 16000 - y.size))))
    assert abs(int(np.argmax(spec)) - 440) <= 1
    if lossless:
        np.testing.assert_allclose(y[200:-200], ref[200:-200], atol=2e-3)
    assert 0.4 < float(np.abs(y).max()) < 0.65


def test_stereo_is_averaged(tmp_path):
    import soundfile as sf

    rate = 8000
    sf.write(str(tmp_path / "s.flac"), np.stack([np.full(800, 0.2), np.full(800, 0.4)], axis=1), rate)
    y = load_audio(tmp_path / "s.flac", rate)
    np.testing.assert_allclose(y, 0.3, atol=1e-4)


def test_bad_audio_raises_media_error(tmp_path):
    write_audio(tmp_path / "ok.flac", tone(0.5, 16000), 16000)
    data = (tmp_path / "ok.flac").read_bytes()
    (tmp_path / "trunc.flac").write_bytes(data[:40])
    (tmp_path / "junk.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunkjunk")
    write_audio(tmp_path / "empty.wav", np.zeros(0, dtype=np.float32), 16000)
    for name in ("trunc.flac", "junk.wav", "empty.wav"):
        with pytest.raises(MediaError) as info:
            load_audio(tmp_path / name, 16000)
        assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------ video
def test_frame_sampling_follows_the_qwen2_vl_rule():
    s = VideoSettings(fps=2.0, min_frames=4, max_frames=768)
    # 10 frames at 5 fps = 2 s -> 4 frames (2 fps), indices arange(0, 10, 2.5).int()
    assert sample_indices(VideoMeta(10, 5.0, 56, 56), s).tolist() == [0, 2, 5, 7]
    # 300 frames at 30 fps = 10 s -> 20 frames every 15
    assert sample_indices(VideoMeta(300, 30.0, 56, 56), s).tolist() == list(range(0, 300, 15))
    # 3 frames, min_frames 4 -> capped by the video, rounded down to the temporal patch (2)
    assert sample_indices(VideoMeta(3, 30.0, 56, 56), s).tolist() == [0, 1]
    # max_frames bounds a long video: 6000 frames at 30 fps, 2 fps -> 400 > max 8
    assert len(sample_indices(VideoMeta(6000, 30.0, 56, 56), VideoSettings(max_frames=8))) == 8
    with pytest.raises(MediaError, match="fewer than the temporal patch"):
        sample_indices(VideoMeta(1, 30.0, 56, 56), s)
    assert smart_resize(56, 84, 28, 28 * 28, 28 * 28 * 16) == (56, 84)
    assert smart_resize(480, 640, 28, 28 * 28, 28 * 28 * 16) == (84, 112)  # max_pixels: scaled down
    assert smart_resize(10, 10, 28, 56 * 56, 28 * 28 * 16) == (56, 56)  # min_pixels: scaled up


def test_mp4_frames_decode_like_transformers_reader(tmp_path):
    from transformers.video_utils import read_video_pyav

    frames = blocky_frames(10, 56, 84)
    write_video(tmp_path / "v.mp4", frames, fps=5)
    meta = probe(tmp_path / "v.mp4")
    assert meta == VideoMeta(10, 5.0, 56, 84)
    idx = sample_indices(meta, TINY_VIDEO)
    got = decode_frames(tmp_path / "v.mp4", idx)
    hf, hf_meta = read_video_pyav(str(tmp_path / "v.mp4"), lambda metadata, **kw: idx)
    assert hf_meta.total_num_frames == meta.total_frames and hf_meta.fps == meta.fps
    np.testing.assert_array_equal(got, hf)  # the same frames as transformers' own PyAV reader
    assert np.abs(got.astype(int) - frames[idx].astype(int)).max() <= 8  # what was written, up to chroma coding


def test_patches_equal_the_hf_image_processor_on_still_frames():
    """The runnable HF reference here: ``Qwen2VLImageProcessorPil`` turns one image into a temporal patch by
    repeating it, so a video whose frames come in equal pairs must give exactly its patches, frame pair by pair
    (same normalisation, same patch layout). Frames already at their ``smart_resize`` size are not resampled."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ip = Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=28 * 28,
                                  max_pixels=28 * 28 * 16)
    a, b = blocky_frames(2, 56, 84, seed=3)
    patches, grid = frames_to_patches(np.stack([a, a, b, b]), VideoSettings.of(ip))
    ref = ip([a, b], return_tensors="np")
    assert grid == (2, 4, 6) and ref["image_grid_thw"].tolist() == [[1, 4, 6]] * 2
    np.testing.assert_allclose(patches, ref["pixel_values"], rtol=0, atol=1e-5)
    # an odd frame count repeats the last frame, as the HF video processor pads the temporal axis
    odd, g3 = frames_to_patches(np.stack([a, a, b]), VideoSettings.of(ip))
    np.testing.assert_array_equal(odd, patches) if g3 == grid else pytest.fail(f"grid {g3}")


def test_resizing_matches_pil_bicubic():
    """Frames off the patch grid are resized as torchvision resizes uint8 tensors (bicubic, antialias, float32,
    rounded); PIL's bicubic (the image processor's) agrees to within a level of 255 almost everywhere."""
    from PIL import Image

    frame = np.random.default_rng(0).integers(0, 256, (100, 150, 3), dtype=np.uint8)
    frame = np.asarray(Image.fromarray(frame).resize((150, 100), Image.BILINEAR))  # some spatial correlation
    s = VideoSettings(min_pixels=28 * 28, max_pixels=28 * 28 * 16)
    h, w = smart_resize(100, 150, 28, s.min_pixels, s.max_pixels)
    patches, grid = frames_to_patches(np.stack([frame, frame]), s)
    pil = np.asarray(Image.fromarray(frame).resize((w, h), Image.BICUBIC)).astype(np.float32)
    # patches [i, j, a, b] x [C, tp, y, x] -> pixels [(i a y), (j b x), C], one temporal copy
    ours = patches.reshape(grid[1] // 2, grid[2] // 2, 2, 2, 3, 2, 14, 14)[:, :, :, :, :, 0]
    ours = ours.transpose(0, 2, 5, 1, 3, 6, 4).reshape(h, w, 3)
    ours = ours * (np.asarray(s.image_std) * 255) + np.asarray(s.image_mean) * 255
    d = np.abs(ours - pil)
    # PIL rounds to uint8 between its horizontal and vertical passes (clamping overshoot early): rare larger gaps
    assert d.mean() < 0.5 and (d > 1.01).mean() < 0.02, (d.mean(), (d > 1.01).mean())


def test_video_tensors_and_second_per_grid(tmp_path):
    write_video(tmp_path / "v.mp4", blocky_frames(12, 60, 90), fps=4)  # 3 s -> 6 frames -> t = 3
    out = video_tensors([tmp_path / "v.mp4", tmp_path / "v.mp4"], TINY_VIDEO)
    h, w = smart_resize(60, 90, 28, TINY_VIDEO.min_pixels, TINY_VIDEO.max_pixels)
    assert out["video_grid_thw"].tolist() == [[3, h // 14, w // 14]] * 2
    assert out["pixel_values_videos"].shape == (2 * 3 * (h // 14) * (w // 14), 3 * 2 * 14 * 14)
    assert out["pixel_values_videos"].dtype == np.float32
    assert out["second_per_grid_ts"].tolist() == [1.0, 1.0]  # temporal patch 2 / 2 fps


# ------------------------------------------------------------------------------------------------ rows
def test_bad_media_rows_are_skipped_and_counted(tmp_path, caplog):
    from PIL import Image

    tok = build_tiny_bpe_tokenizer()
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pre = MultimodalPreprocessor(tok, image_processor=Qwen2VLImageProcessorPil(
        patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=28 * 28, max_pixels=28 * 28 * 16),
        feature_extractor=WhisperFeatureExtractor(**TINY_AUDIO), video=TINY_VIDEO)
    Image.fromarray(blocky_frames(1, 56, 56)[0]).save(tmp_path / "ok.jpg")
    (tmp_path / "trunc.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 10)
    write_audio(tmp_path / "ok.flac", tone(0.5, 16000), 16000)
    write_audio(tmp_path / "empty.wav", np.zeros(0, dtype=np.float32), 16000)
    write_video(tmp_path / "ok.mp4", blocky_frames(8, 56, 56), fps=4)
    with av.open(str(tmp_path / "noframes.mp4"), "w") as c:  # a valid container whose video stream is empty
        st = c.add_stream("libx264", rate=4)
        st.width = st.height = 56
    (tmp_path / "junk.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x07" * 64)
    rows = [{"prompt": "ok", "answer": 1, "images": ["ok.jpg"], "audios": ["ok.flac"], "videos": ["ok.mp4"]},
            {"prompt": "missing", "answer": 1, "images": ["nope.png"]},
            {"prompt": "truncated", "answer": 1, "images": ["trunc.png"]},
            {"prompt": "empty audio", "answer": 1, "audios": ["empty.wav"]},
            {"prompt": "no frames", "answer": 1, "videos": ["noframes.mp4"]},
            {"prompt": "corrupt video", "answer": 1, "videos": ["junk.mp4"]},
            {"prompt": "<video> then <audio>", "answer": 2, "videos": ["ok.mp4"], "audios": ["ok.flac"]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="relax_hpc.data.dataset"):
        ds = PromptDataset(DataConfig(path=str(path)), tok, 0, multimodal=pre)
    assert len(ds) == 2 and ds.stats()["data/bad_media"] == 5
    lines = [r.getMessage() for r in caplog.records if "media cannot be used" in r.getMessage()]
    assert len(lines) == 1 and "nope.png" in lines[0] and "\n" not in lines[0]
    p0, p1 = ds[0], ds[1]
    assert set(p0.multimodal) == {"pixel_values", "image_grid_thw", "input_features", "feature_attention_mask",
                                  "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"}
    vid = tok.convert_tokens_to_ids("<|video_pad|>")
    assert p1.prompt_ids.count(vid) == int(p1.multimodal["video_grid_thw"].prod()) // 4
    text = tok.decode(p1.prompt_ids)
    assert text.index("<|video_pad|>") < text.index(" then ") < text.index("<|AUDIO|>")
    assert p1.media["video"][0].name == "ok.mp4"  # the raw media travel beside the tensors (server engines)
    lazy = ds.prompt(1, tensors=False)
    assert lazy.multimodal is None and lazy.prompt_ids == p1.prompt_ids and lazy.media == p1.media

    # a file that breaks after loading: the stream skips that prompt with one line and goes on
    (tmp_path / "ok.mp4").write_bytes((tmp_path / "ok.mp4").read_bytes()[:200])
    stream = PromptStream(ds, num_epochs=1, shuffle=False)
    with caplog.at_level(logging.WARNING, logger="relax_hpc.data.stream"):
        got = stream.next_batch(2)
    assert got == [] and stream.num_media_skipped == 2 and stream.exhausted
    assert sum("skipped prompt" in r.getMessage() for r in caplog.records) == 2
