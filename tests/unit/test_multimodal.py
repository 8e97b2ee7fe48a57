"""Multimodal prompts: JSONL rows with PNG images / WAV audios -> Prompt tensors, and the tiny Qwen2.5-VL and
Qwen2-Audio models' forward + backward + generate on them (CPU, tiny sizes)."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.config.schema import DataConfig, TinyModelConfig
from relax_hpc.data import PromptDataset
from relax_hpc.data.media import load_audio, write_wav
from relax_hpc.errors import UserError
from relax_hpc.models.multimodal import (
    build_tiny_audio_model,
    build_tiny_bpe_tokenizer,
    build_tiny_vl_model,
    tiny_preprocessor,
)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tok():
    return build_tiny_bpe_tokenizer()


def png(path: Path, h: int, w: int, seed: int = 0) -> Path:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def tone(path: Path, seconds: float, rate: int = 16000) -> Path:
    t = np.arange(int(seconds * rate)) / rate
    write_wav(path, 0.5 * np.sin(2 * np.pi * 440 * t), rate)
    return path


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def check_model(model, prompt, tok) -> None:
    """Forward + backward with labels, then greedy generate, on one prompt's ids and tensors."""
    ids = torch.tensor([prompt.prompt_ids])
    mm = {k: torch.from_numpy(v) for k, v in prompt.multimodal.items()}
    out = model(input_ids=ids, labels=ids, **mm)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters()
             if ("visual" in n or "audio_tower" in n) and p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)  # the media really flowed into the loss
    model.zero_grad()
    gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         pad_token_id=tok.pad_token_id, **mm)
    assert gen.shape[0] == 1 and ids.shape[1] < gen.shape[1] <= ids.shape[1] + 4


# ------------------------------------------------------------------------------------------------ images
def test_image_rows_become_vl_prompts_and_run_the_tiny_vl_model(tok, tmp_path):
    (tmp_path / "img").mkdir()
    png(tmp_path / "img" / "a.png", 64, 80)
    png(tmp_path / "img" / "b.png", 30, 30, seed=1)
    path = jsonl(tmp_path / "vl.jsonl", [
        {"prompt": "How many shapes?", "answer": "3", "images": ["img/a.png"]},
        {"prompt": "Compare <image> with <image>.", "answer": "same", "images": ["img/a.png", "img/b.png"]},
    ])
    pre = tiny_preprocessor("qwen2_5_vl", tok)
    ds = PromptDataset(DataConfig(path=str(path)), tok, 0, multimodal=pre)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")

    p0, p1 = ds[0], ds[1]
    grid = p0.multimodal["image_grid_thw"]
    assert grid.dtype == np.int64 and grid.shape == (1, 3)
    assert p0.multimodal["pixel_values"].dtype == np.float32
    assert p0.multimodal["pixel_values"].shape == (int(grid.prod()), 3 * 2 * 14 * 14)
    assert p0.prompt_ids.count(pad) == int(grid.prod()) // 4
    text = tok.decode(p0.prompt_ids)
    assert text.index("<|vision_start|>") < text.index("How many shapes?")  # no marker: image goes first

    grids = p1.multimodal["image_grid_thw"]
    assert grids.shape == (2, 3) and p1.prompt_ids.count(pad) == int(grids.prod(axis=1).sum()) // 4
    text = tok.decode(p1.prompt_ids)
    assert text.index("Compare ") < text.index("<|vision_start|>") < text.index(" with ")  # markers keep their place

    model = build_tiny_vl_model(TinyModelConfig(), tok, seed=0)
    check_model(model, p1, tok)


def test_parquet_rows_with_image_bytes(tok, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    buf = io.BytesIO(png(tmp_path / "x.png", 56, 56).read_bytes())
    rows = [{"prompt": [{"role": "user", "content": "<image>What is x?"}], "reward_model": {"ground_truth": "2"},
             "images": [{"bytes": buf.getvalue(), "path": None}]}]  # the layout of common geometry-QA Parquet files
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "geo.parquet")
    ds = PromptDataset(DataConfig(path=str(tmp_path / "geo.parquet"), answer_key="reward_model.ground_truth"), tok,
                       0, multimodal=tiny_preprocessor("qwen2_5_vl", tok))
    p = ds[0]
    assert p.answer == "2"
    assert p.multimodal["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert p.prompt_ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == 4


def test_image_errors_are_one_line(tok, tmp_path):
    png(tmp_path / "a.png", 32, 32)
    pre = tiny_preprocessor("qwen2_5_vl", tok)

    def err(rows, **kw) -> str:
        with pytest.raises(UserError) as info:
            PromptDataset(DataConfig(path=str(jsonl(tmp_path / "e.jsonl", rows))), tok, 0, **kw)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "the model is text-only" in err([{"prompt": "a", "answer": 1, "images": ["a.png"]}])
    assert "image file" in err([{"prompt": "a", "answer": 1, "images": ["nope.png"]}], multimodal=pre)
    assert "2 image and 0 audio placeholders but the row has 1 images" in err(
        [{"prompt": "<image><image>", "answer": 1, "images": ["a.png"]}], multimodal=pre)
    assert "takes no audio input" in err([{"prompt": "a", "answer": 1, "audios": ["a.png"]}], multimodal=pre)


# ------------------------------------------------------------------------------------------------ audio
def test_audio_rows_become_prompts_and_run_the_tiny_audio_model(tok, tmp_path):
    tone(tmp_path / "short.wav", 0.37)
    tone(tmp_path / "long.wav", 2.5, rate=8000)  # resampled to 16 kHz, truncated to the 1 s window
    path = jsonl(tmp_path / "au.jsonl", [
        {"prompt": "What do you hear?", "answer": "a tone", "audios": ["short.wav"]},
        {"prompt": "<audio> then <audio>: same?", "answer": "yes", "audios": ["short.wav", "long.wav"]},
    ])
    pre = tiny_preprocessor("qwen2_audio", tok)
    ds = PromptDataset(DataConfig(path=str(path)), tok, 0, multimodal=pre)
    audio_id = tok.convert_tokens_to_ids("<|AUDIO|>")
    p0, p1 = ds[0], ds[1]
    feats, mask = p0.multimodal["input_features"], p0.multimodal["feature_attention_mask"]
    assert feats.shape == (1, 16, 100) and feats.dtype == np.float32 and mask.dtype == np.int32
    assert mask.sum() == 37  # 0.37 s at a 10 ms hop
    assert p0.prompt_ids.count(audio_id) == ((37 - 1) // 2 + 1 - 2) // 2 + 1
    assert p1.multimodal["feature_attention_mask"].sum(axis=1).tolist() == [37, 100]
    assert p1.prompt_ids.count(audio_id) == 9 + 25

    model = build_tiny_audio_model(TinyModelConfig(), tok, seed=0)
    check_model(model, p1, tok)


@pytest.mark.parametrize("seconds", [0.01, 0.2, 0.999, 1.0, 1.7])
def test_audio_token_count_matches_the_feature_extractor(tok, tmp_path, seconds):
    pre = tiny_preprocessor("qwen2_audio", tok)
    ref = tone(tmp_path / "t.wav", seconds)
    assert pre.token_counts(pre.tensors([], [ref]))[1] == [pre.audio_tokens(ref)]


def _wav(tag: int, bits: int, channels: int, frames: bytes, rate: int = 16000) -> bytes:
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    return (b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(frames)) + b"WAVE" + b"fmt " +
            struct.pack("<I", len(fmt)) + fmt + b"LIST" + struct.pack("<I", 2) + b"xx" +  # a chunk to skip
            b"data" + struct.pack("<I", len(frames)) + frames)


@pytest.mark.parametrize(("tag", "bits", "raw"), [
    (1, 8, np.array([128, 192, 64], dtype=np.uint8).tobytes()),
    (1, 16, np.array([0, 16384, -16384], dtype="<i2").tobytes()),
    (1, 24, b"\x00\x00\x00" + b"\x00\x00\x40" + b"\x00\x00\xc0"),
    (1, 32, np.array([0, 2**30, -(2**30)], dtype="<i4").tobytes()),
    (3, 32, np.array([0.0, 0.5, -0.5], dtype="<f4").tobytes()),
    (3, 64, np.array([0.0, 0.5, -0.5], dtype="<f8").tobytes()),
])
def test_wav_decoding(tag, bits, raw):
    np.testing.assert_allclose(load_audio(_wav(tag, bits, 1, raw), 16000), [0.0, 0.5, -0.5], atol=1e-6)


def test_wav_stereo_is_averaged_and_resampled():
    frames = np.array([[0.2, 0.4]] * 800, dtype="<f4").tobytes()
    x = load_audio(_wav(3, 32, 2, frames, rate=8000), 16000)
    assert x.shape == (1600,) and np.allclose(x[100:-100], 0.3, atol=1e-3)
    with pytest.raises(UserError, match="cannot decode audio"):
        load_audio(b"OggS....", 16000)
