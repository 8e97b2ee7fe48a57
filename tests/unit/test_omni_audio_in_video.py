"""``use_audio_in_video`` for the Omni thinkers: a video whose audio track is interleaved with its frames, chunk by
chunk, in the token layout the HF processors make (their own ``replace_video_with_audio_token``, called on a
stand-in holding just its token names: the full processors need torchvision, which does not import beside this
torch). The 3-D positions of such samples are computed per sample inside packed micro-batches: the logits equal the
model's own computation one sample at a time (``use_audio_in_video=True``), beside text-only and plain media samples
in the same rows; and the interleaving is detected per sample from its tokens."""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace

import numpy as np
import pytest

from relax_hpc.config.schema import TinyModelConfig
from relax_hpc.data.media import write_audio
from relax_hpc.data.video import write_video
from relax_hpc.models.multimodal import build_tiny_bpe_tokenizer, build_tiny_multimodal_model, tiny_preprocessor
from relax_hpc.trainer.batch import TrainItem, pack, response_logits

torch = pytest.importorskip("torch")
pytest.importorskip("av")

HF = {"qwen2_5_omni": ("qwen2_5_omni.processing_qwen2_5_omni", "Qwen2_5OmniProcessor"),
      "qwen3_omni": ("qwen3_omni_moe.processing_qwen3_omni_moe", "Qwen3OmniMoeProcessor")}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_bpe_tokenizer()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("aiv")
    rng = np.random.default_rng(0)
    for i, t in enumerate([12, 20]):  # 3 s and 5 s at 4 fps: several position chunks of 2 s
        small = rng.integers(0, 256, (t, 7, 8, 3), dtype=np.uint8)
        write_video(d / f"v{i}.mp4", np.repeat(np.repeat(small, 8, 1), 8, 2), fps=4)
        write_audio(d / f"v{i}.flac", 0.3 * np.sin(np.arange(t * 4000) * 0.02 * (i + 1)), 16000)  # its track
    return d


def hf_placeholder(arch: str, model: object, mm: dict, tok) -> str:
    """The text the HF processor puts between ``<vision_start>`` and ``<vision_end>`` for a video with its audio."""
    mod = importlib.import_module(f"transformers.models.{HF[arch][0]}")
    cls = getattr(mod, HF[arch][1])
    fake = SimpleNamespace(audio_bos_token="<|audio_bos|>", audio_eos_token="<|audio_eos|>",
                           video_token="<|video_pad|>", audio_token="<|AUDIO|>",
                           video_processor=SimpleNamespace(merge_size=2))
    fake.get_chunked_index = functools.partial(cls.get_chunked_index, fake)
    frames = np.asarray(mm["feature_attention_mask"]).sum(-1)
    n_audio = mod._get_feat_extract_output_lengths(frames)
    cfg = model.config
    return cls.replace_video_with_audio_token(
        fake, {"video_grid_thw": np.asarray(mm["video_grid_thw"]),
               "video_second_per_grid": [float(x) for x in mm["second_per_grid_ts"]]}, 0,
        {"num_audio_tokens": n_audio}, 0, position_id_per_seconds=cfg.position_id_per_seconds,
        seconds_per_chunk=getattr(cfg, "seconds_per_chunk", 2.0))


def rope_of(model):
    from relax_hpc.models.mrope import MRope

    return MRope.of(model)


def aiv_item(arch, model, tok, pre, media, i: int, n_resp: int) -> TrainItem:
    mm = pre.tensors([], [media / f"v{i}.flac"], [media / f"v{i}.mp4"])
    text = ("<|im_start|>user\nWatch and listen: <|vision_start|>" + hf_placeholder(arch, model, mm, tok) +
            "<|vision_end|> what happens?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    resp = np.random.default_rng(i).integers(20, 200, n_resp)
    return TrainItem.of(prompt_ids=np.asarray(ids), response_ids=resp, logprobs=np.zeros(n_resp, np.float32),
                     loss_mask=np.ones(n_resp), tensors=mm)


def alone(model, it: TrainItem, audio_in_video: bool) -> torch.Tensor:
    """Response logits of one sample, the model computing its own positions (as in ``generate``)."""
    ids = torch.from_numpy(np.concatenate([it.sample.prompt_ids, it.sample.response_ids])).long()[None]
    rope = rope_of(model)
    mm = it.sample.tensors
    kw = rope.model_kwargs([{k: torch.from_numpy(v) for k, v in mm.items()}]) if mm else {}
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                use_audio_in_video=audio_in_video, **kw).logits[0]
    p = len(it.sample.prompt_ids)
    return out[p - 1:p - 1 + len(it.sample.response_ids)]


@pytest.mark.parametrize("arch", ["qwen2_5_omni", "qwen3_omni"])
def test_audio_in_video_positions_in_packed_micro_batches(arch, tok, media):
    model = build_tiny_multimodal_model(TinyModelConfig(arch=arch), tok, seed=0).eval()
    pre = tiny_preprocessor(arch, tok)
    rope = rope_of(model)
    items = [aiv_item(arch, model, tok, pre, media, 0, 6)]
    ids = tok("<|im_start|>user\nplain text<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    items.append(TrainItem.of(prompt_ids=np.asarray(ids["input_ids"]), response_ids=np.arange(30, 37),
                           logprobs=np.zeros(7, np.float32), loss_mask=np.ones(7)))
    plain = pre.tensors([], [media / "v1.flac"], [media / "v1.mp4"])  # the same media, not interleaved
    text = "<|im_start|>user\n" + pre.placeholders["video"] + pre.placeholders["audio"] + "?<|im_end|>\n"
    img, aud, vid = pre.token_counts(plain)
    ids = pre.expand(tok(text, add_special_tokens=False)["input_ids"], img, aud, "t", video_counts=vid)
    items.append(TrainItem.of(prompt_ids=np.asarray(ids), response_ids=np.arange(40, 45),
                           logprobs=np.zeros(5, np.float32), loss_mask=np.ones(5), tensors=plain))
    items.append(aiv_item(arch, model, tok, pre, media, 1, 4))
    layout = tok.decode(items[0].sample.prompt_ids)
    first_audio, last_video = layout.index("<|AUDIO|>"), layout.rindex("<|video_pad|>")
    assert first_audio < last_video  # interleaved: video chunk, audio chunk, video chunk ...
    flags = [rope.audio_in_video(torch.as_tensor(it.sample.prompt_ids)) for it in items]
    assert flags == [True, False, False, True]
    with torch.no_grad():
        ref = [alone(model, it, f) for it, f in zip(items, flags, strict=True)]
        for rows in (False, True):
            mb = pack(items, 10**6, rows=rows, pack_multimodal=True)[0]
            got = response_logits(model, mb)
            for s, it in enumerate(mb.items):
                k = next(j for j, x in enumerate(items) if x is it)
                torch.testing.assert_close(got[mb.seq_ids == s], ref[k], rtol=1e-4, atol=1e-4)
        # the interleaved positions matter: computed as if the audio were not in the video, the logits differ
        assert (alone(model, items[0], False) - ref[0]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------ the data side
@pytest.fixture(scope="module")
def av_rows(tmp_path_factory):
    """A real MP4 with an AAC audio track (44.1 kHz, resampled to the extractor's 16 kHz when loaded), a silent
    MP4, and rows naming them."""
    import json

    d = tmp_path_factory.mktemp("avrows")
    rng = np.random.default_rng(1)
    frames = np.repeat(np.repeat(rng.integers(0, 256, (12, 7, 8, 3), dtype=np.uint8), 8, 1), 8, 2)  # 3 s, 4 fps
    tone = 0.4 * np.sin(2 * np.pi * 440 * np.arange(3 * 44100) / 44100)
    write_video(d / "talk.mp4", frames, fps=4, audio=(tone, 44100))
    write_video(d / "silent.mp4", frames[:8], fps=4)
    rows = [{"prompt": "<video>What do you hear?", "answer": "A", "videos": ["talk.mp4"]},
            {"prompt": "<video>What moves?", "answer": "B", "videos": ["silent.mp4"]},
            {"prompt": "<video>Again?", "answer": "A", "videos": ["talk.mp4"],
             "media_options": {"use_audio_in_video": False}}]
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def av_dataset(arch, tok, rows_dir, **media):
    from relax_hpc.config.schema import DataConfig
    from relax_hpc.data import PromptDataset

    cfg = DataConfig(path=str(rows_dir / "rows.jsonl"), media=media, max_prompt_tokens=4096)
    return PromptDataset(cfg, tok, seed=0, multimodal=tiny_preprocessor(arch, tok))


def between_vision(tok, ids) -> list[int]:
    ids = list(ids)
    start = ids.index(tok.convert_tokens_to_ids("<|vision_start|>"))
    return ids[start + 1:ids.index(tok.convert_tokens_to_ids("<|vision_end|>"))]


@pytest.mark.parametrize("arch", ["qwen2_5_omni", "qwen3_omni"])
def test_use_audio_in_video_feeds_the_videos_audio_track(arch, tok, av_rows):
    from relax_hpc.data.media import load_audio

    model = build_tiny_multimodal_model(TinyModelConfig(arch=arch), tok, seed=0).eval()
    ds = av_dataset(arch, tok, av_rows, use_audio_in_video=True)
    pre = ds.multimodal
    talk, silent, off = ds[0], ds[1], ds[2]
    # the audio track, decoded by PyAV and resampled 44.1 -> 16 kHz, is the tone that was muxed
    wave = load_audio(av_rows / "talk.mp4", 16000)
    assert abs(len(wave) - 3 * 16000) < 1200
    ref = 0.4 * np.sin(2 * np.pi * 440 * np.arange(len(wave)) / 16000)
    assert np.corrcoef(wave[1000:40000], ref[1000:40000])[0, 1] > 0.999
    fe = pre.feature_extractor
    want = fe([wave], sampling_rate=16000, padding="max_length", truncation=True, return_attention_mask=True,
              return_tensors="np")
    np.testing.assert_array_equal(talk.multimodal["input_features"], want["input_features"])
    np.testing.assert_array_equal(talk.multimodal["feature_attention_mask"], want["attention_mask"])
    # its tokens: exactly what the HF processor puts inside the video (its own replace_video_with_audio_token)
    hf = tok(hf_placeholder(arch, model, talk.multimodal, tok), add_special_tokens=False)["input_ids"]
    assert between_vision(tok, talk.prompt_ids) == hf
    assert talk.media == {"audio": [av_rows / "talk.mp4"], "video": [av_rows / "talk.mp4"]}
    assert between_vision(tok, talk.engine_prompt_ids) == [pre.video_token_id]  # server engines: one per item
    # a silent video, and a row that turns the option off, keep the plain video tokens and no audio
    for p in (silent, off):
        assert "input_features" not in p.multimodal
        vid = pre.token_counts(p.multimodal)[2]
        assert between_vision(tok, p.prompt_ids) == [pre.video_token_id] * vid[0]
    # packed with the others, the dataset's prompt gets the positions the model computes for it alone
    rope = rope_of(model)
    items = [TrainItem.of(prompt_ids=np.asarray(p.prompt_ids), response_ids=np.arange(30, 35),
                       logprobs=np.zeros(5, np.float32), loss_mask=np.ones(5), tensors=p.multimodal)
             for p in (talk, silent, off)]
    flags = [rope.audio_in_video(torch.as_tensor(it.sample.prompt_ids)) for it in items]
    assert flags == [True, False, False]
    with torch.no_grad():
        mb = pack(items, 10**6, pack_multimodal=True)[0]
        got = response_logits(model, mb)
        for s, it in enumerate(mb.items):
            k = next(j for j, x in enumerate(items) if x is it)
            torch.testing.assert_close(got[mb.seq_ids == s], alone(model, items[k], flags[k]), rtol=1e-4, atol=1e-4)


def test_use_audio_in_video_refuses_rows_with_audios_and_models_without_it(tok, av_rows, tmp_path):
    import json

    from relax_hpc.data.media import write_audio as wa
    from relax_hpc.errors import UserError

    wa(tmp_path / "a.wav", np.zeros(1600) + 0.1, 16000)
    (tmp_path / "talk.mp4").write_bytes((av_rows / "talk.mp4").read_bytes())
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "<video><audio>?", "answer": "A",
                                                     "videos": ["talk.mp4"], "audios": ["a.wav"]}) + "\n")
    with pytest.raises(UserError, match="use_audio_in_video takes the audio of the row's videos"):
        av_dataset("qwen2_5_omni", tok, tmp_path, use_audio_in_video=True)
    with pytest.raises(UserError, match="use_audio_in_video needs an Omni thinker"):
        av_dataset("qwen2_5_vl", tok, av_rows, use_audio_in_video=True)
