"""Tiny Qwen2.5-VL, Qwen2.5-Omni and Qwen3-Omni-MoE thinkers on prompts mixing text, images, audios and videos
(real PNG/FLAC/MP4 files): 3-D rotary positions per sample inside packed micro-batches give the same logits as one
sample at a time (the model computing its own positions), and a micro-batch without media still runs every encoder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from relax_hpc.config.schema import DataConfig, TinyModelConfig
from relax_hpc.data import PromptDataset
from relax_hpc.data.media import write_audio
from relax_hpc.data.video import write_video
from relax_hpc.models.multimodal import build_tiny_bpe_tokenizer, build_tiny_multimodal_model, tiny_preprocessor
from relax_hpc.trainer.batch import TrainItem, pack, response_logits

torch = pytest.importorskip("torch")
pytest.importorskip("av")

ARCHS = ["qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni"]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_bpe_tokenizer()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    from PIL import Image

    d = tmp_path_factory.mktemp("omni")
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(64, 64), (40, 90)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / f"im{i}.png")
    for i, n in enumerate([9000, 16000]):
        write_audio(d / f"a{i}.flac", 0.4 * np.sin(np.arange(n) * 0.03 * (i + 2)), 16000)
    for i, (t, w) in enumerate([(8, 64), (12, 48)]):
        small = rng.integers(0, 256, (t, 8, w // 8, 3), dtype=np.uint8)
        write_video(d / f"v{i}.mp4", np.repeat(np.repeat(small, 8, 1), 8, 2), fps=4)
    return d


def rows_for(arch: str) -> list[dict]:
    rows = [{"prompt": "Look: <image> then <video>. Same?", "answer": 1, "images": ["im0.png"],
             "videos": ["v1.mp4"]},
            {"prompt": "Plain text prompt", "answer": 0},
            {"prompt": "<video><image> and <image>", "answer": 2, "videos": ["v0.mp4"], "images": ["im1.png",
                                                                                                 "im0.png"]}]
    if arch not in ("qwen2_5_vl", "qwen3_vl"):
        rows += [{"prompt": "Hear <audio>, see <image>, watch <video>", "answer": 3, "audios": ["a1.flac"],
                  "images": ["im1.png"], "videos": ["v0.mp4"]},
                 {"prompt": "<audio><audio> which is higher?", "answer": 4, "audios": ["a0.flac", "a1.flac"]}]
    return rows


def items_for(arch: str, tok, media) -> list[TrainItem]:
    path = media / f"{arch}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_for(arch)))
    ds = PromptDataset(DataConfig(path=str(path), shuffle=False), tok, 0, multimodal=tiny_preprocessor(arch, tok))
    rng = np.random.default_rng(1)
    items = []
    for i in range(len(ds)):
        p = ds[i]
        resp = rng.integers(20, 200, 5 + 3 * i)
        items.append(TrainItem.of(prompt_ids=np.asarray(p.prompt_ids), response_ids=resp,
                               logprobs=np.zeros(len(resp), np.float32), loss_mask=np.ones(len(resp)),
                               tensors=p.multimodal or {}))
    return items


def alone_logits(model, it: TrainItem) -> torch.Tensor:
    """Response logits of one sample, the model computing its own 3-D positions (as in ``generate``)."""
    from relax_hpc.models.mrope import MRope

    ids = torch.from_numpy(np.concatenate([it.sample.prompt_ids, it.sample.response_ids])).long()[None]
    mm = {k: torch.from_numpy(v) for k, v in it.sample.tensors.items()}
    rope = MRope.of(model)
    kw = rope.model_kwargs([mm]) if mm else {}
    if rope.family == "vl":
        types = torch.zeros_like(ids, dtype=torch.int32)
        types[ids == rope.image_token_id] = 1
        types[ids == rope.video_token_id] = 2
        kw["mm_token_type_ids"] = types
    else:  # Omni thinkers compute 3-D positions only when given an attention mask (as generate gives them)
        kw["attention_mask"] = torch.ones_like(ids)
    out = model(input_ids=ids, use_cache=False, **kw).logits[0]
    p = len(it.sample.prompt_ids)
    return out[p - 1:p - 1 + len(it.sample.response_ids)]


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_logits_equal_one_sample_at_a_time(arch, tok, media):
    items = items_for(arch, tok, media)
    assert any("pixel_values_videos" in it.sample.tensors for it in items)
    assert any(not it.sample.tensors for it in items)
    model = build_tiny_multimodal_model(TinyModelConfig(arch=arch), tok, seed=0).eval()
    with torch.no_grad():
        ref = [alone_logits(model, it) for it in items]
        for rows in (False, True):
            mbs = pack(items, 10**6, rows=rows, pack_multimodal=True)
            assert len(mbs) == 1
            if arch != "qwen3_vl":  # for its prompt lengths (timestamped frames) one row is the cheapest layout
                assert (mbs[0].input_ids.shape[0] > 1) == rows
            mb = mbs[0]
            got = response_logits(model, mb)
            for s, it in enumerate(mb.items):
                want = ref[next(k for k, x in enumerate(items) if x is it)]
                torch.testing.assert_close(got[mb.seq_ids == s], want, rtol=1e-4, atol=1e-4)
        # the 3-D positions matter: plain 1-D positions give other logits for a sample with media
        mb = pack([items[0]], 10**6)[0]
        plain = model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False,
                      **{k: v for k, v in response_kwargs(model, mb).items()}).logits[0][mb.logit_index]
        assert (plain - ref[0]).abs().max() > 1e-3


def response_kwargs(model, mb):
    from relax_hpc.models.mrope import packed_inputs

    kw = packed_inputs(model, mb)[1]
    kw.pop("_encoder_dummy", None)
    return kw


def grads_of(model, items, encoder: str) -> dict[str, float]:
    """|grad| sum per parameter of ``encoder`` after fwd+bwd of one micro-batch of ``items`` (absent: no grad)."""
    model.zero_grad(set_to_none=True)
    response_logits(model, pack(items, 10**6, pack_multimodal=True)[0]).float().logsumexp(-1).mean().backward()
    return {n: float(p.grad.abs().sum()) for n, p in getattr(model.model, encoder).named_parameters()
            if p.grad is not None}


@pytest.mark.parametrize("arch", ARCHS)
def test_text_only_micro_batch_runs_every_encoder(arch, tok, media):
    """Every encoder parameter that a micro-batch with media trains also takes part (with gradient 0) in a
    micro-batch without: FSDP ranks then gather and reduce the same parameters in every micro-batch."""
    model = build_tiny_multimodal_model(TinyModelConfig(arch=arch), tok, seed=0)
    items = items_for(arch, tok, media)
    text, image = items[1], items[0]
    assert not text.sample.tensors and "pixel_values" in image.sample.tensors
    encoders = [n for n in ("visual", "audio_tower") if hasattr(model.model, n)]
    assert encoders == (["visual"] if arch in ("qwen2_5_vl", "qwen3_vl") else ["visual", "audio_tower"])
    real = {"visual": grads_of(model, [image], "visual")}
    if "audio_tower" in encoders:
        audio = items[4]
        assert "input_features" in audio.sample.tensors and "pixel_values" not in audio.sample.tensors
        real["audio_tower"] = grads_of(model, [audio], "audio_tower")
        # an audio-only micro-batch runs the vision tower on a dummy, and the other way round
        assert set(grads_of(model, [audio], "visual")) == set(real["visual"])
        assert set(grads_of(model, [image], "audio_tower")) == set(real["audio_tower"])
    for name in encoders:
        dummy = grads_of(model, [text], name)
        assert real[name] and any(v > 0 for v in real[name].values())
        assert set(dummy) == set(real[name]), name  # the same parameters take part
        assert all(v == 0.0 for v in dummy.values())  # with weight 0: the loss is unchanged


def test_training_step_on_a_packed_omni_micro_batch(tok, media):
    """fwd + bwd through the Qwen3-Omni-MoE thinker on packed image/audio/video samples: gradients reach both
    encoders."""
    items = items_for("qwen3_omni", tok, media)
    model = build_tiny_multimodal_model(TinyModelConfig(arch="qwen3_omni"), tok, seed=0)
    mb = pack(items, 10**6, pack_multimodal=True)[0]
    logits = response_logits(model, mb)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, mb.targets[:, None])[:, 0]
    (-logp.mean()).backward()
    for name in ("visual", "audio_tower"):
        assert any(p.grad is not None and float(p.grad.abs().sum()) > 0
                   for p in getattr(model.model, name).parameters()), name


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_5_omni"])
def test_placeholder_tokens_sampled_in_a_response_are_plain_tokens(arch, tok, media):
    """A policy may sample ``<|image_pad|>``: generation embeds it as a plain token at a text position, and so must
    the trainer (the model's placeholder matching never sees it; its own embedding is kept)."""
    item = items_for(arch, tok, media)[0]
    img, pad = tok.convert_tokens_to_ids("<|image_pad|>"), tok.pad_token_id
    model = build_tiny_multimodal_model(TinyModelConfig(arch=arch), tok, seed=0).eval()

    def logits_with(mid: int):
        resp = np.asarray([40, mid, 41, 42, 43])
        it = TrainItem.of(prompt_ids=item.sample.prompt_ids, response_ids=resp, logprobs=np.zeros(5, np.float32),
                       loss_mask=np.ones(5), tensors=item.sample.tensors)
        with torch.no_grad():
            return response_logits(model, pack([it], 10**6, pack_multimodal=True)[0])

    stray, plain = logits_with(img), logits_with(pad)
    torch.testing.assert_close(stray[:2], plain[:2])  # before the token: the same
    assert (stray[2:] - plain[2:]).abs().max() > 1e-4  # after it: its own embedding, not the substitute's
    emb = model.get_input_embeddings()
    assert getattr(emb, "_relax_stray_hook", None) is None and not emb._forward_hooks  # the hook removed itself


@pytest.mark.parametrize("arch", ["qwen2_5_omni", "qwen3_omni"])
def test_omni_checkpoint_folder_loads_by_path(arch, tok, tmp_path):
    """A thinker saved as an HF folder (weights, tokenizer, one preprocessor_config.json holding the image
    processor's and the feature extractor's keys, as Omni checkpoints ship it) loads by path with its preprocessor."""
    from relax_hpc.config.schema import ModelConfig
    from relax_hpc.models.load import load_model
    from relax_hpc.models.multimodal import build_preprocessor

    model = build_tiny_multimodal_model(TinyModelConfig(arch=arch), tok, seed=3)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    pre = tiny_preprocessor(arch, tok)
    conf = {**pre.feature_extractor.to_dict(), **pre.image_processor.to_dict()}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(conf, default=list))
    got = build_preprocessor(ModelConfig(path=str(tmp_path)), tok)
    assert got.token_ids == pre.token_ids and got.audio_out_len is pre.audio_out_len
    assert (got.video.patch_size, got.video.min_pixels, got.video.max_pixels) == (
        pre.video.patch_size, pre.video.min_pixels, pre.video.max_pixels)
    assert got.feature_extractor.feature_size == pre.feature_extractor.feature_size
    loaded = load_model(ModelConfig(path=str(tmp_path)), tok, device="cpu", dtype=torch.float32)
    assert type(loaded) is type(model)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values(),
                                                  strict=True))
