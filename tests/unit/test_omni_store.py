"""Omni-modal samples through the real sample store and into the trainer: prompts with 0-2 images, 0-2 audios and
0-1 videos (real files), their float32/int64/int32 tensors plus bfloat16 and uint8 ones, written to an HDF5 shard
and read back bit for bit, then trained on (tiny Qwen2.5-Omni thinker); and the two token streams (server engines:
one placeholder per item beside the raw media; trainer: the expanded placeholders) align."""

from __future__ import annotations

import json

import numpy as np
import pytest

from relax_hpc.config.schema import DataConfig, TinyModelConfig
from relax_hpc.data import PromptDataset
from relax_hpc.data.media import write_audio
from relax_hpc.data.messages import build_messages
from relax_hpc.data.video import decode_frames, probe, sample_indices, write_video
from relax_hpc.models.multimodal import build_tiny_bpe_tokenizer, build_tiny_multimodal_model, tiny_preprocessor
from relax_hpc.rundir import RunDir
from relax_hpc.store import Sample, SampleGroup, ShardWriter, read_shard, to_torch

torch = pytest.importorskip("torch")
pytest.importorskip("av")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from PIL import Image

    d = tmp_path_factory.mktemp("omni-store")
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(64, 64), (40, 96), (70, 50)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(d / f"im{i}.jpg" if i else d / "im0.png")
    for i, n in enumerate([7000, 16000, 3000]):
        write_audio(d / (f"a{i}.mp3" if i == 2 else f"a{i}.wav"), 0.4 * np.sin(np.arange(n) * 0.02 * (i + 1)), 16000)
    for i, t in enumerate([6, 10]):
        small = rng.integers(0, 256, (t, 8, 8, 3), dtype=np.uint8)
        write_video(d / f"v{i}.mp4", np.repeat(np.repeat(small, 8, 1), 8, 2), fps=4)
    rows = [{"prompt": "text only", "answer": 0},
            {"prompt": "<image><image><audio> ?", "answer": 1, "images": ["im0.png", "im1.jpg"], "audios": ["a0.wav"]},
            {"prompt": "<video> then <audio><audio>", "answer": 2, "videos": ["v1.mp4"],
             "audios": ["a1.wav", "a2.mp3"]},
            {"prompt": "<image> <video>", "answer": 3, "images": ["im2.jpg"], "videos": ["v0.mp4"]}]
    (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = build_tiny_bpe_tokenizer()
    pre = tiny_preprocessor("qwen2_5_omni", tok)
    ds = PromptDataset(DataConfig(path=str(d / "rows.jsonl"), shuffle=False), tok, 0, multimodal=pre)
    return d, rows, tok, pre, ds


def samples(ds, d) -> list[Sample]:
    rng = np.random.default_rng(2)
    out = []
    for i in range(len(ds)):
        p = ds[i]
        tensors = dict(p.multimodal or {})
        dtypes = {}
        if "pixel_values" in tensors:  # a bfloat16 copy (as a bf16 engine/trainer would hand it over)
            tensors["pixel_values_bf16"] = torch.from_numpy(tensors["pixel_values"]).to(torch.bfloat16)
        if p.media and "video" in p.media:  # the decoded uint8 frames
            meta = probe(p.media["video"][0])
            tensors["frames_u8"] = decode_frames(p.media["video"][0], sample_indices(meta, ds.multimodal.video))
            dtypes["frames_u8"] = "uint8"
        n = int(rng.integers(3, 9))
        out.append(Sample(prompt_ids=np.asarray(p.prompt_ids), response_ids=rng.integers(20, 300, n),
                          logprobs=-rng.random(n).astype(np.float32), reward=float(i), tensors=tensors,
                          tensor_dtypes=dtypes, metadata={"row": i}))
    return out


def test_every_tensor_comes_back_bit_identical_and_trains(setup, tmp_path):
    from relax_hpc.trainer.batch import pack, response_logits
    from relax_hpc.trainer.items import samples_to_items

    d, rows, tok, _pre, ds = setup
    written = samples(ds, d)
    counts = [sum(len(r.get(k, [])) for k in ("images", "audios", "videos")) for r in rows]
    assert counts == [0, 3, 3, 2]  # variable counts per sample, text-only included
    rd = RunDir.create(tmp_path / "run")
    info = ShardWriter(rd, "rollout-0.omni").write([SampleGroup("g0", written[:2]), SampleGroup("g1", written[2:])])
    back = sorted(read_shard(info.path), key=lambda s: s.metadata["row"])
    for w, r in zip(written, back, strict=True):
        assert r.prompt_ids.tolist() == list(w.prompt_ids)
        assert set(r.tensors) == set(w.tensors)
        for k, v in w.tensors.items():
            if isinstance(v, torch.Tensor):  # bf16: stored as raw bits, the logical dtype recorded
                assert r.tensor_dtypes[k] == "bfloat16" and r.tensors[k].dtype == np.uint16
                assert torch.equal(to_torch(r.tensors[k], "bfloat16"), v)
                assert to_torch(r.tensors[k], "bfloat16").view(torch.int16).equal(v.view(torch.int16))
            else:
                assert r.tensors[k].dtype == v.dtype and r.tensors[k].shape == v.shape, k
                assert r.tensors[k].tobytes() == v.tobytes(), k
    items = samples_to_items(back)
    assert items[3].sample.model_inputs()["pixel_values_bf16"].dtype == torch.bfloat16  # the model's inputs
    assert items[2].sample.model_inputs()["frames_u8"].dtype == torch.uint8
    model = build_tiny_multimodal_model(TinyModelConfig(arch="qwen2_5_omni"), tok, seed=0)
    for it in items:  # the trainer's inputs: drop the extra copies the model does not take
        it.sample.tensors = {k: v for k, v in it.sample.tensors.items() if k not in ("pixel_values_bf16", "frames_u8")}
    mb = pack(items, 10**6, pack_multimodal=True)[0]
    logp = torch.log_softmax(response_logits(model, mb).float(), -1).gather(-1, mb.targets[:, None])[:, 0]
    (-logp.mean()).backward()
    assert torch.isfinite(logp).all() and model.model.audio_tower.conv1.weight.grad.abs().sum() > 0


def test_engine_and_trainer_token_streams_align(setup):
    _d, rows, tok, pre, ds = setup
    pads = {pre.image_token_id: "image", pre.audio_token_id: "audio", pre.video_token_id: "video"}
    for i, row in enumerate(rows):
        p = ds.prompt(i, tensors=False)
        if not p.media:
            assert p.engine_prompt_ids is None
            continue
        full = ds[i]
        # the engine stream is the chat template's own tokens, before expansion
        msgs = build_messages(row["prompt"], system_prompt=None, num_images=len(row.get("images", [])),
                              num_audios=len(row.get("audios", [])), num_videos=len(row.get("videos", [])),
                              origin="t", key="prompt")
        raw = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert p.engine_prompt_ids == list(raw)
        # one placeholder per item, in the order of the media the engine gets
        kinds = [pads[t] for t in p.engine_prompt_ids if t in pads]
        assert sorted(kinds) == sorted(k for k, refs in p.media.items() for _ in refs)
        # expanding the engine stream by the tensors' counts gives the trainer stream exactly
        img, aud, vid = pre.token_counts(full.multimodal)
        assert pre.expand(p.engine_prompt_ids, img, aud, "t", video_counts=vid) == full.prompt_ids
        assert pre.compact(full.prompt_ids) == p.engine_prompt_ids
        # and the text between placeholders is the same token for token
        strip = [t for t in full.prompt_ids if t not in pads]
        assert strip == [t for t in p.engine_prompt_ids if t not in pads]
