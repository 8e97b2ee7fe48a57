"""Multimodal models: tiny Qwen2.5-VL, Qwen3-VL, Qwen2-Audio and Omni thinkers (their own section at the end) made
from config (random weights, offline), an offline byte-level BPE tokenizer with their special tokens, and the
prompt-side preprocessing that turns a prompt's images and audios into the named tensors the sample store carries.

The combined HF *processors* of these models need torchvision, so the image processor (``Qwen2VLImageProcessorPil``)
and the audio feature extractor (``WhisperFeatureExtractor``) are used directly, and the placeholder tokens are
expanded here: each ``<|image_pad|>`` becomes ``image_grid_thw.prod() // merge_size**2`` copies, each ``<|AUDIO|>``
the audio encoder's output length. The tensors are named as the models' ``forward`` takes them::

    pixel_values            float32 [sum of patches, 3 * temporal_patch * patch * patch]
    image_grid_thw          int64   [num_images, 3]
    input_features          float32 [num_audios, num_mel_bins, frames]
    feature_attention_mask  int32   [num_audios, frames]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from relax_hpc.config.schema import ModelConfig, TinyModelConfig
from relax_hpc.data.media import MediaRef, image_size, load_audio, load_image
from relax_hpc.errors import ConfigError, UserError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
AUDIO_PLACEHOLDER = "<|audio_bos|><|AUDIO|><|audio_eos|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
PLACEHOLDERS = {"image": IMAGE_PLACEHOLDER, "audio": AUDIO_PLACEHOLDER, "video": VIDEO_PLACEHOLDER}
# Qwen-style ChatML; string contents or typed parts (text / image / audio / video), as the Qwen2.5-VL and Qwen2-Audio
# templates render them.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}" + IMAGE_PLACEHOLDER + "{% elif p['type'] == 'audio' %}" + AUDIO_PLACEHOLDER +
    "{% elif p['type'] == 'video' %}" + VIDEO_PLACEHOLDER +
    "{% elif 'text' in p %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = ("What is 12 plus 30? The answer is 42. Describe the image. What do you hear in the audio? "
           "Reason step by step, then put the final answer in \\boxed{}. 0123456789 +-*/=(). ")

TINY_IMAGE = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 28 * 28,
              "max_pixels": 28 * 28 * 16}
"""Image processor of the tiny VL model: images become at most 4x4 merged tokens."""
TINY_VISION = {"depth": 2, "hidden_size": 128, "intermediate_size": 256, "num_heads": 4, "fullatt_block_indexes": [1]}
"""Vision tower of the tiny VL model (its output width is the text model's hidden size). Width 128: with width 32 the
random tower's features of different images were too alike for the tiny text model to learn counting red squares
(supervised probes stayed at chance after 300 steps; width 128 takes off after ~180; docs/benchmarks.md)."""
TINY_PROJECTOR_GAIN = 30.0
"""The tiny VL model's projector (the vision merger's two linear layers) starts with weights this many times the
random initialisation (std 0.02 -> 0.6): the image tokens then stand out in the text model's residual stream, and
supervised probes on ``red_squares`` take off after 80-140 steps instead of ~180 to more than 300."""
TINY_AUDIO = {"feature_size": 16, "sampling_rate": 16000, "hop_length": 160, "chunk_length": 1, "n_fft": 400}
"""Feature extractor of the tiny audio model: 1 s windows of 16 mel bins (100 frames -> 25 audio tokens)."""


def build_tiny_bpe_tokenizer(*, vocab_size: int = 400, corpus: list[str] | None = None) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained offline (milliseconds) on a small built-in corpus, with
    the Qwen special tokens of images and audio and a ChatML chat template. eos = ``<|im_end|>``, pad =
    ``<|endoftext|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus or [_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def token_id_of(tokenizer: Any, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ConfigError(f"the tokenizer has no {token} token (needed for multimodal prompts)")
    return int(tid)


def audio_out_len_qwen2(frames: Any) -> Any:
    """Audio tokens of Qwen2-Audio / Qwen2.5-Omni for ``frames`` mel frames (convolution stride 2, pooling 2)."""
    return (((frames - 1) // 2 + 1) - 2) // 2 + 1


def audio_out_len_qwen3_omni(frames: Any, n_window: int = 50) -> Any:
    """Audio tokens of Qwen3-Omni for ``frames`` mel frames (chunks of ``2 * n_window`` frames, 13 tokens each)."""
    leave = frames % (n_window * 2)
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (frames // (n_window * 2)) * 13


@dataclass(frozen=True)
class AudioInVideo:
    """How an Omni thinker interleaves a video's audio tokens with its frames' (``use_audio_in_video``): the
    ``replace_video_with_audio_token`` of its HF processor. Video tokens sit at time ``grid * seconds_per_grid *
    position_id_per_seconds``, audio token ``i`` at time ``i``. ``chunked`` (Qwen2.5-Omni): chunks of
    ``position_id_per_seconds * seconds_per_chunk`` time steps, each chunk's video tokens then its audio tokens.
    ``merged`` (Qwen3-Omni): one merge by time, a video token first on a tie."""

    style: Literal["chunked", "merged"]
    bos_id: int
    eos_id: int
    position_id_per_seconds: float = 25.0
    seconds_per_chunk: float = 2.0

    def order(self, t: int, tokens_per_grid: int, seconds_per_grid: float, audio_tokens: int) -> list[str]:
        """The kinds (``video``/``audio``) of the interleaved tokens, in order."""
        vid = np.repeat(np.arange(t), tokens_per_grid) * seconds_per_grid * self.position_id_per_seconds
        aud = np.arange(audio_tokens)
        if self.style == "merged":
            out, i, j = [], 0, 0
            while i < len(vid) and j < len(aud):
                if vid[i] <= aud[j]:
                    out.append("video")
                    i += 1
                else:
                    out.append("audio")
                    j += 1
            return out + ["video"] * (len(vid) - i) + ["audio"] * (len(aud) - j)
        per_chunk = int(self.position_id_per_seconds * self.seconds_per_chunk)
        v_chunks, a_chunks = _chunk_sizes(vid, per_chunk), _chunk_sizes(aud, per_chunk)
        out = []
        for k in range(max(len(v_chunks), len(a_chunks))):
            out += ["video"] * (v_chunks[k] if k < len(v_chunks) else 0)
            out += ["audio"] * (a_chunks[k] if k < len(a_chunks) else 0)
        return out


def _chunk_sizes(times: np.ndarray, per_chunk: int) -> list[int]:
    """Sizes of the runs of ``times`` (non-decreasing) in [0, c), [c, 2c), ... up to the last value's run, as the
    HF processors' ``get_chunked_index`` cuts them (a run may be empty)."""
    sizes, start, chunk = [], 0, 1
    for i, v in enumerate(times):
        if v >= chunk * per_chunk:
            sizes.append(i - start)
            start, chunk = i, chunk + 1
    sizes.append(len(times) - start)
    return sizes


def _collapse_audio_in_video(ids: list[int], layout: AudioInVideo, video_id: int) -> list[int]:
    """``ids`` with each ``<|audio_bos|>`` block that holds video tokens replaced by one video token."""
    out: list[int] = []
    k = 0
    while k < len(ids):
        if ids[k] == layout.bos_id and k + 1 < len(ids) and ids[k + 1] == video_id:
            end = ids.index(layout.eos_id, k) if layout.eos_id in ids[k:] else len(ids) - 1
            out.append(video_id)
            k = end + 1
        else:
            out.append(ids[k])
            k += 1
    return out


class MultimodalPreprocessor:
    """Images/audios/videos of one prompt -> model tensors, and the matching expansion of the placeholder tokens.

    ``video`` (:class:`relax_hpc.data.video.VideoSettings`) enables videos; ``placeholders`` maps a kind to the
    string its chat-template part renders as (the token repeated is ``tokens[kind]``)."""

    def __init__(self, tokenizer: Any, *, image_processor: Any = None, feature_extractor: Any = None,
                 video: Any = None, image_token: str = "<|image_pad|>", audio_token: str = "<|AUDIO|>",
                 video_token: str = "<|video_pad|>", placeholders: dict[str, str] | None = None,
                 audio_out_len: Any = audio_out_len_qwen2, audio_in_video: AudioInVideo | None = None,
                 vision_tokens: tuple[str, str] = ("<|vision_start|>", "<|vision_end|>")):
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.feature_extractor = feature_extractor
        self.video = video
        self.audio_out_len = audio_out_len
        self.token_ids: dict[str, int] = {}
        for kind, have, tok in (("image", image_processor, image_token), ("audio", feature_extractor, audio_token),
                                ("video", video, video_token)):
            if have is not None:
                self.token_ids[kind] = token_id_of(tokenizer, tok)
        self.image_token_id = self.token_ids.get("image")
        self.audio_token_id = self.token_ids.get("audio")
        self.video_token_id = self.token_ids.get("video")
        self.placeholders = {**PLACEHOLDERS, **(placeholders or {})}
        self.image_placeholder = self.placeholders["image"]
        self.audio_placeholder = self.placeholders["audio"]
        self.image_pixels: tuple[int, int] | None = None
        """(min, max) pixels of an image after resizing, overriding the image processor's (``with_options``)."""
        self.audio_in_video_layout = audio_in_video
        """How the model interleaves a video's audio with its frames (None: it cannot)."""
        self.use_audio_in_video = False
        """Feed each video's audio track as the sample's audio (``with_options``: ``use_audio_in_video``)."""
        self.video_token = video_token
        self.vision_start, self.vision_end = vision_tokens

    def with_options(self, options: dict[str, Any], origin: str = "data.media") -> MultimodalPreprocessor:
        """A copy with media knobs overridden (keys of ``relax_hpc.config.schema.MEDIA_OPTION_KEYS``; ``None``
        values ignored); ``self`` when there is nothing to change."""
        import copy
        import dataclasses

        from relax_hpc.config.schema import MEDIA_OPTION_KEYS

        opts = {k: v for k, v in options.items() if v is not None}
        if unknown := sorted(set(opts) - set(MEDIA_OPTION_KEYS)):
            raise UserError(f"{origin}: unknown media options {unknown}; known: {list(MEDIA_OPTION_KEYS)}")
        if not opts:
            return self
        new = copy.copy(self)
        if self.image_processor is not None and ("image_min_pixels" in opts or "image_max_pixels" in opts):
            lo, hi = self.image_pixels or (int(self.image_processor.size["shortest_edge"]),
                                           int(self.image_processor.size["longest_edge"]))
            new.image_pixels = (int(opts.get("image_min_pixels", lo)), int(opts.get("image_max_pixels", hi)))
        if opts.get("use_audio_in_video"):
            if self.audio_in_video_layout is None or self.feature_extractor is None or self.video is None:
                raise UserError(f"{origin}: use_audio_in_video needs an Omni thinker (Qwen2.5-Omni / Qwen3-Omni), "
                                "which takes a video's audio with its frames")
            new.use_audio_in_video = True
        video = {k[len("video_"):]: v for k, v in opts.items() if k.startswith("video_")}
        if self.video is not None and video:
            new.video = dataclasses.replace(self.video, **video)
        return new

    def _need(self, kind: str) -> None:
        if kind not in self.token_ids:
            raise UserError(f"the data has {kind}s but the model takes no {kind} input")

    # -------------------------------------------------------------------------------------------- token counts
    def image_tokens(self, ref: MediaRef) -> int:
        """Placeholder tokens of one image, from its header only (no decoding)."""
        self._need("image")
        h, w = image_size(ref)
        merge = int(self.image_processor.merge_size)
        kw = {"min_pixels": self.image_pixels[0], "max_pixels": self.image_pixels[1]} if self.image_pixels else {}
        return int(self.image_processor.get_number_of_image_patches(h, w, images_kwargs=kw)) // merge**2

    def _audio_frames(self, num_samples: int) -> int:
        fe = self.feature_extractor
        return min(-(-min(num_samples, fe.n_samples) // fe.hop_length), fe.nb_max_frames)

    def audio_tokens(self, ref: MediaRef) -> int:
        """Placeholder tokens of one audio (its length after the encoder's convolutions and pooling)."""
        self._need("audio")
        samples = load_audio(ref, self.feature_extractor.sampling_rate)
        return int(self.audio_out_len(self._audio_frames(samples.size)))

    def video_tokens(self, ref: MediaRef) -> int:
        """Placeholder tokens of one video, from its header only."""
        from relax_hpc.data.video import num_tokens

        self._need("video")
        return num_tokens(ref, self.video)

    def count(self, kind: str, ref: MediaRef) -> int:
        """Placeholder tokens of one item of ``kind``."""
        return {"image": self.image_tokens, "audio": self.audio_tokens, "video": self.video_tokens}[kind](ref)

    def expand(self, ids: list[int], image_counts: list[int], audio_counts: list[int], origin: str,
               video_counts: list[int] | None = None, video_layouts: list[list[int] | None] | None = None) -> list[int]:
        """``ids`` with the i-th image (audio, video) placeholder token repeated ``image_counts[i]``
        (``audio_counts[i]``, ``video_counts[i]``) times; a video with a ``video_layouts[i]`` (its tokens interleaved
        with its audio's, :meth:`audio_in_video_tokens`) becomes that instead. The number of placeholders must equal
        the number of items."""
        todo: dict[int, list[int]] = {}
        names: dict[int, str] = {}
        for kind, counts in (("image", image_counts), ("audio", audio_counts), ("video", video_counts or [])):
            if counts:
                self._need(kind)
                todo[self.token_ids[kind]] = list(counts)
                names[self.token_ids[kind]] = kind
        seen = dict.fromkeys(todo, 0)
        out: list[int] = []
        layouts = video_layouts or []
        for t in ids:
            if t in todo:
                counts, k = todo[t], seen[t]
                if t == self.video_token_id and k < len(layouts) and layouts[k] is not None:
                    out.extend(layouts[k])  # type: ignore[arg-type]
                elif k < len(counts):
                    out.extend([t] * counts[k])
                seen[t] += 1
            else:
                out.append(t)
        for t, counts in todo.items():
            if seen[t] != len(counts):
                raise UserError(f"{origin}: the tokenized prompt has {seen[t]} placeholder tokens {t} for "
                                f"{len(counts)} {names[t]}s (does the chat template render {names[t]} content "
                                "parts?)")
        return out

    def video_layouts(self, videos: list[MediaRef], video_audio: list[int | None] | None,
                      audio_counts: list[int]) -> list[list[int] | None] | None:
        """The tokens each video's placeholder token becomes where it is not a plain run of video tokens: with its
        audio interleaved (``video_audio[i]``: its audio's index, :meth:`audio_in_video_tokens`), or Qwen3-VL's
        frames with their timestamps (:meth:`timestamped_video_tokens`); None when every video is a plain run."""
        if self.video is not None and self.video.style == "qwen3_vl":
            return [self.timestamped_video_tokens(v) for v in videos]
        if video_audio is None:
            return None
        return [None if a is None else self.audio_in_video_tokens(v, audio_counts[a])
                for v, a in zip(videos, video_audio, strict=True)]

    def timestamped_video_tokens(self, ref: MediaRef) -> list[int]:
        """Qwen3-VL's tokens for one video, as its processor's ``replace_video_token`` writes them: per temporal
        patch ``<{t:.1f} seconds><|vision_start|>`` + its video tokens + ``<|vision_end|>``."""
        from relax_hpc.data.video import grid, probe, sample_indices, timestamps

        assert self.video is not None
        meta = probe(ref)
        t, h, w = grid(meta, self.video)
        per_frame = h * w // self.video.merge_size**2
        text = "".join(f"<{ts:.1f} seconds>{self.vision_start}{self.video_token * per_frame}{self.vision_end}"
                       for ts in timestamps(sample_indices(meta, self.video), meta.fps,
                                            self.video.temporal_patch_size)[:t])
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]

    def audio_in_video_tokens(self, ref: MediaRef, audio_tokens: int) -> list[int]:
        """The tokens of a video that carries its audio (``audio_tokens`` of them), as the Omni processors lay them
        out between ``<|vision_start|>`` and ``<|vision_end|>``: ``<|audio_bos|>``, video and audio tokens
        interleaved by time (:class:`AudioInVideo`), ``<|audio_eos|>``."""
        from relax_hpc.data.video import grid, probe

        layout = self.audio_in_video_layout
        assert layout is not None and self.video is not None, "checked by with_options"
        t, h, w = grid(probe(ref), self.video)
        m = self.video.merge_size
        per_grid = self.video.temporal_patch_size / self.video.fps
        kinds = layout.order(t, h * w // m**2, per_grid, audio_tokens)
        ids = {"video": self.token_ids["video"], "audio": self.token_ids["audio"]}
        return [layout.bos_id, *(ids[k] for k in kinds), layout.eos_id]

    def compact(self, ids: list[int]) -> list[int]:
        """The inverse of :meth:`expand`: every run of a placeholder token back to one token, i.e. the prompt as a
        server engine takes it beside the raw media (it expands the placeholders itself). Runs of the same kind are
        always separated (by ``<|vision_end|>``/``<|audio_eos|>`` ...), so each run is one item. A video with its
        audio interleaved (``<|audio_bos|>`` video/audio tokens ``<|audio_eos|>``) becomes one video token (the
        engine gets the video and its audio track among the raw media)."""
        pads = set(self.token_ids.values())
        layout = self.audio_in_video_layout
        if layout is not None and "video" in self.token_ids:
            ids = _collapse_audio_in_video(ids, layout, self.token_ids["video"])
        return [t for k, t in enumerate(ids) if t not in pads or k == 0 or ids[k - 1] != t]

    # -------------------------------------------------------------------------------------------- tensors
    def tensors(self, images: list[MediaRef], audios: list[MediaRef],
                videos: list[MediaRef] | None = None) -> dict[str, np.ndarray]:
        """The named model inputs of a prompt's media (see the module docstring)."""
        out: dict[str, np.ndarray] = {}
        if images:
            self._need("image")
            kw = ({"size": {"shortest_edge": self.image_pixels[0], "longest_edge": self.image_pixels[1]}}
                  if self.image_pixels else {})
            feats = self.image_processor([load_image(r) for r in images], return_tensors="np", **kw)
            out["pixel_values"] = np.asarray(feats["pixel_values"], dtype=np.float32)
            out["image_grid_thw"] = np.asarray(feats["image_grid_thw"], dtype=np.int64)
        if audios:
            self._need("audio")
            fe = self.feature_extractor
            waves = [load_audio(r, fe.sampling_rate) for r in audios]
            feats = fe(waves, sampling_rate=fe.sampling_rate, padding="max_length", truncation=True,
                       return_attention_mask=True, return_tensors="np")
            out["input_features"] = np.asarray(feats["input_features"], dtype=np.float32)
            out["feature_attention_mask"] = np.asarray(feats["attention_mask"], dtype=np.int32)
        if videos:
            from relax_hpc.data.video import video_tensors

            self._need("video")
            out.update(video_tensors(videos, self.video))
        return out

    def token_counts(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], list[int], list[int]]:
        """Placeholder tokens per image, per audio and per video implied by ``tensors`` (to check :meth:`expand`)."""
        img: list[int] = []
        aud: list[int] = []
        vid: list[int] = []
        if "image_grid_thw" in tensors:
            merge = int(self.image_processor.merge_size)
            img = [int(n) // merge**2 for n in tensors["image_grid_thw"].prod(axis=-1)]
        if "feature_attention_mask" in tensors:
            aud = [int(n) for n in self.audio_out_len(tensors["feature_attention_mask"].sum(axis=-1))]
        if "video_grid_thw" in tensors:
            vid = [int(n) // self.video.merge_size**2 for n in tensors["video_grid_thw"].prod(axis=-1)]
        return img, aud, vid


# ------------------------------------------------------------------------------------------------ factories
def tiny_preprocessor(arch: str, tokenizer: Any) -> MultimodalPreprocessor | None:
    """The preprocessor of a tiny model of ``arch`` (None for the text-only ``qwen3``)."""
    if arch == "qwen2_5_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from relax_hpc.data.video import VideoSettings

        video = VideoSettings(fps=2.0, min_frames=2, max_frames=8, patch_size=14, merge_size=2, temporal_patch_size=2,
                              min_pixels=TINY_IMAGE["min_pixels"], max_pixels=TINY_IMAGE["max_pixels"])
        return MultimodalPreprocessor(tokenizer, image_processor=Qwen2VLImageProcessorPil(**TINY_IMAGE), video=video)
    if arch == "qwen3_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        from relax_hpc.data.video import VideoSettings

        half = (0.5, 0.5, 0.5)
        px = {"min_pixels": 32 * 32, "max_pixels": 32 * 32 * 16}
        ip = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=half,
                                      image_std=half, **px)
        video = VideoSettings(style="qwen3_vl", fps=2.0, min_frames=2, max_frames=8, patch_size=16, merge_size=2,
                              temporal_patch_size=2, min_pixels=32 * 32 * 2, max_pixels=32 * 32 * 64,
                              image_mean=half, image_std=half)
        return MultimodalPreprocessor(tokenizer, image_processor=ip, video=video)
    if arch in ("qwen2_5_omni", "qwen3_omni"):
        return tiny_omni_preprocessor(arch, tokenizer)
    if arch == "qwen2_audio":
        from transformers import WhisperFeatureExtractor

        return MultimodalPreprocessor(tokenizer, feature_extractor=WhisperFeatureExtractor(**TINY_AUDIO))
    return None


def build_preprocessor(cfg: ModelConfig, tokenizer: Any) -> MultimodalPreprocessor | None:
    """The preprocessor for the recipe's model: by ``tiny.arch`` for ``tiny``, else by the ``model_type`` of the
    model's config (Qwen2/2.5-VL: its image processor; Qwen2-Audio: its feature extractor; Qwen2.5-Omni /
    Qwen3-Omni: both and videos; others: None)."""
    if cfg.path == "tiny":
        return tiny_preprocessor(cfg.tiny.arch, tokenizer)
    from pathlib import Path

    from transformers import AutoConfig

    path = str(Path(cfg.path).expanduser()) if cfg.path.startswith("~") else cfg.path  # a local folder under ~
    try:
        model_type = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code).model_type
    except OSError as exc:
        raise UserError(f"model.path: cannot read the config of {cfg.path!r}: {str(exc).splitlines()[0]}") from exc
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return MultimodalPreprocessor(tokenizer, image_processor=Qwen2VLImageProcessorPil.from_pretrained(path))
    if model_type in ("qwen3_vl", "qwen3_vl_moe"):
        return qwen3_vl_preprocessor(cfg, tokenizer)
    if model_type == "qwen2_audio":
        from transformers import WhisperFeatureExtractor

        return MultimodalPreprocessor(tokenizer, feature_extractor=WhisperFeatureExtractor.from_pretrained(path))
    if model_type in OMNI_MODEL_TYPES:
        return omni_preprocessor(cfg, tokenizer, model_type)
    return None


OMNI_MODEL_TYPES = ("qwen2_5_omni", "qwen2_5_omni_thinker", "qwen3_omni_moe", "qwen3_omni_moe_thinker")


def omni_preprocessor(cfg: ModelConfig, tokenizer: Any, model_type: str) -> MultimodalPreprocessor:
    """Images, audios and videos of a Qwen2.5-Omni / Qwen3-Omni checkpoint folder: its image processor, Whisper
    feature extractor and video settings (``video_preprocessor_config.json`` when present, else the image
    processor's patching), and the placeholder tokens its config names."""
    import json
    from pathlib import Path

    from transformers import AutoConfig, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from relax_hpc.data.video import VideoSettings

    conf = AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code)
    conf = getattr(conf, "thinker_config", conf)

    def token(*names: str) -> str:
        tid = next(v for v in (getattr(conf, n, None) for n in names) if v is not None)
        return str(tokenizer.convert_ids_to_tokens(int(tid)))

    ip = Qwen2VLImageProcessorPil.from_pretrained(cfg.path)
    vpath = Path(cfg.path).expanduser() / "video_preprocessor_config.json"
    vconf = json.loads(vpath.read_text()) if vpath.is_file() else {}
    video = VideoSettings.of(type("VideoConfig", (), vconf)() if vconf else ip)
    image_t, audio_t, video_t = (token("image_token_id", "image_token_index"),
                                 token("audio_token_id", "audio_token_index"),
                                 token("video_token_id", "video_token_index"))
    qwen3 = model_type.startswith("qwen3")
    bos = int(conf.audio_start_token_id)
    eos = getattr(conf, "audio_end_token_id", None)  # Qwen3-Omni's config names only the start: its pair's end
    if eos is None:
        name = str(tokenizer.convert_ids_to_tokens(bos))
        eos = token_id_of(tokenizer, name.replace("_start|>", "_end|>").replace("_bos|>", "_eos|>"))
    layout = AudioInVideo("merged" if qwen3 else "chunked", bos, eos, float(conf.position_id_per_seconds),
                          float(getattr(conf, "seconds_per_chunk", 2.0) or 2.0))
    return MultimodalPreprocessor(tokenizer, image_processor=ip, video=video,
                                  feature_extractor=WhisperFeatureExtractor.from_pretrained(cfg.path),
                                  image_token=image_t, audio_token=audio_t, video_token=video_t,
                                  audio_out_len=audio_out_len_qwen3_omni if qwen3 else audio_out_len_qwen2,
                                  audio_in_video=layout)


def qwen3_vl_preprocessor(cfg: ModelConfig, tokenizer: Any) -> MultimodalPreprocessor:
    """Images and videos of a Qwen3-VL checkpoint folder: its image processor (patch 16) and its video processor's
    settings (``video_preprocessor_config.json``; Qwen3-VL's sampling, pixel budget and timestamps)."""
    import json
    from pathlib import Path

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from relax_hpc.data.video import VideoSettings

    ip = Qwen2VLImageProcessorPil.from_pretrained(cfg.path)
    vpath = Path(cfg.path).expanduser() / "video_preprocessor_config.json"
    if not vpath.is_file():
        raise UserError(f"model.path: {cfg.path} has no video_preprocessor_config.json (Qwen3-VL's video settings)")
    video = VideoSettings.of(type("VideoConfig", (), json.loads(vpath.read_text()))(), style="qwen3_vl")
    return MultimodalPreprocessor(tokenizer, image_processor=ip, video=video)


def build_tiny_qwen3_vl_model(cfg: TinyModelConfig, tokenizer: Any, *, seed: int = 0) -> Any:
    """A small ``Qwen3VLForConditionalGeneration`` with random weights: the text model shaped by ``cfg``
    (interleaved M-RoPE), a 2-block vision tower of width 32 (patch 16, merge 2, one deepstack layer)."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = tiny_text_config(cfg, tokenizer)
    half = cfg.hidden_size // cfg.num_heads // 2
    t = max(1, half // 4)
    text.update(head_dim=cfg.hidden_size // cfg.num_heads,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_interleaved": True,
                                 "mrope_section": [t, (half - t) // 2, half - t - (half - t) // 2]})
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size":
              cfg.hidden_size, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "num_position_embeddings": 64, "deepstack_visual_indexes": [1]}
    ids = {k: token_id_of(tokenizer, tok) for k, tok in (("image_token_id", "<|image_pad|>"),
                                                        ("video_token_id", "<|video_pad|>"),
                                                        ("vision_start_token_id", "<|vision_start|>"),
                                                        ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3VLForConditionalGeneration(config)


def tiny_text_config(cfg: TinyModelConfig, tokenizer: Any) -> dict[str, Any]:
    if cfg.hidden_size % cfg.num_heads:
        raise ConfigError(f"model.tiny.hidden_size={cfg.hidden_size} is not divisible by num_heads={cfg.num_heads}")
    return {"vocab_size": len(tokenizer), "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "max_position_embeddings": cfg.max_position,
            "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id}


def build_tiny_vl_model(cfg: TinyModelConfig, tokenizer: Any, *, seed: int = 0) -> Any:
    """A small ``Qwen2_5_VLForConditionalGeneration`` with random weights: the text model shaped by ``cfg``, a
    2-block vision tower (:data:`TINY_VISION`, patch 14, merge 2) matching :data:`TINY_IMAGE`, its projector scaled
    by :data:`TINY_PROJECTOR_GAIN`."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = tiny_text_config(cfg, tokenizer)
    half = cfg.hidden_size // cfg.num_heads // 2  # rotary frequencies per head, split over (t, h, w)
    t = max(1, half // 4)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6,
                               "mrope_section": [t, (half - t) // 2, half - t - (half - t) // 2]}
    vision = {**TINY_VISION, "out_hidden_size": cfg.hidden_size, "patch_size": TINY_IMAGE["patch_size"],
              "spatial_merge_size": TINY_IMAGE["merge_size"], "temporal_patch_size": TINY_IMAGE["temporal_patch_size"]}
    ids = {k: token_id_of(tokenizer, tok) for k, tok in (("image_token_id", "<|image_pad|>"),
                                                        ("video_token_id", "<|video_pad|>"),
                                                        ("vision_start_token_id", "<|vision_start|>"),
                                                        ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    with torch.no_grad():
        for layer in model.model.visual.merger.mlp:
            if isinstance(layer, torch.nn.Linear):
                layer.weight.mul_(TINY_PROJECTOR_GAIN)
    return model


def build_tiny_audio_model(cfg: TinyModelConfig, tokenizer: Any, *, seed: int = 0) -> Any:
    """A small ``Qwen2AudioForConditionalGeneration`` with random weights: the text model shaped by ``cfg``, a
    2-layer audio encoder of width 32 taking :data:`TINY_AUDIO` features (100 frames of 16 mel bins)."""
    import torch
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    text = {"model_type": "qwen2", **tiny_text_config(cfg, tokenizer)}
    frames = TINY_AUDIO["chunk_length"] * TINY_AUDIO["sampling_rate"] // TINY_AUDIO["hop_length"]
    audio = {"model_type": "qwen2_audio_encoder", "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2,
             "encoder_ffn_dim": 64, "num_mel_bins": TINY_AUDIO["feature_size"], "max_source_positions": frames // 2}
    config = Qwen2AudioConfig(audio_config=audio, text_config=text,
                              audio_token_index=token_id_of(tokenizer, "<|AUDIO|>"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2AudioForConditionalGeneration(config)


def build_tiny_multimodal_model(cfg: TinyModelConfig, tokenizer: Any, *, seed: int = 0) -> Any:
    """The tiny model of ``cfg.arch`` (``qwen2_5_vl``, ``qwen3_vl``, ``qwen2_audio``, ``qwen2_5_omni`` or
    ``qwen3_omni``)."""
    if cfg.arch == "qwen2_5_vl":
        return build_tiny_vl_model(cfg, tokenizer, seed=seed)
    if cfg.arch == "qwen3_vl":
        return build_tiny_qwen3_vl_model(cfg, tokenizer, seed=seed)
    if cfg.arch == "qwen2_audio":
        return build_tiny_audio_model(cfg, tokenizer, seed=seed)
    if cfg.arch in ("qwen2_5_omni", "qwen3_omni"):
        return build_tiny_omni(cfg, tokenizer, seed=seed)
    raise ConfigError(f"model.tiny.arch={cfg.arch!r} is not multimodal (use relax_hpc.models.tiny for qwen3)")

# ---------------------------------------------------------------------------------------------------- omni thinkers
# Omni thinkers: tiny Qwen2.5-Omni and Qwen3-Omni-MoE thinkers made from config (random weights, offline) and their
# preprocessors (images, audios, videos); real ones load by path like any HF model
# (``Qwen2_5OmniThinkerForConditionalGeneration`` / ``Qwen3OmniMoeThinkerForConditionalGeneration``).
#
# The tiny models share the offline BPE tokenizer of :mod:`relax_hpc.models.multimodal`: images are
# ``<|vision_start|><|image_pad|><|vision_end|>``, videos ``<|vision_start|><|video_pad|><|vision_end|>``, audios
# ``<|audio_bos|><|AUDIO|><|audio_eos|>`` (the config's token ids point at these tokens). Their 3-D rotary positions
# come from the model's own ``get_rope_index`` (see :mod:`relax_hpc.models.mrope`).

TINY_OMNI_VISION = {"qwen2_5_omni": {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2},
                    "qwen3_omni": {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}}
"""Vision patching of the tiny thinkers (Qwen3-Omni's tower has 16-pixel patches)."""
TINY_OMNI_PIXELS = {"min_pixels": 32 * 32, "max_pixels": 32 * 32 * 16}
"""Images and video frames of the tiny thinkers stay within 16 merged tokens."""


def _mrope_section(cfg: TinyModelConfig) -> list[int]:
    half = cfg.hidden_size // cfg.num_heads // 2
    t = max(1, half // 4)
    return [t, (half - t) // 2, half - t - (half - t) // 2]


def _ids(tokenizer: Any) -> dict[str, int]:
    return {"image": token_id_of(tokenizer, "<|image_pad|>"), "video": token_id_of(tokenizer, "<|video_pad|>"),
            "audio": token_id_of(tokenizer, "<|AUDIO|>"), "vision_start": token_id_of(tokenizer, "<|vision_start|>"),
            "vision_end": token_id_of(tokenizer, "<|vision_end|>"),
            "audio_start": token_id_of(tokenizer, "<|audio_bos|>"),
            "audio_end": token_id_of(tokenizer, "<|audio_eos|>")}


def build_tiny_qwen2_5_omni(cfg: TinyModelConfig, tokenizer: Any, *, seed: int = 0) -> Any:
    """A small ``Qwen2_5OmniThinkerForConditionalGeneration``: the text model shaped by ``cfg``, a 2-block vision
    tower of width 32 (patch 14) and a 2-layer audio encoder of width 32 on :data:`TINY_AUDIO` features."""
    import torch
    from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    ids = _ids(tokenizer)
    text = tiny_text_config(cfg, tokenizer)
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": _mrope_section(cfg)},
                head_dim=cfg.hidden_size // cfg.num_heads, audio_token_index=ids["audio"],
                image_token_index=ids["image"], video_token_index=ids["video"],
                vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
                audio_start_token_id=ids["audio_start"], audio_end_token_id=ids["audio_end"])
    v = TINY_OMNI_VISION["qwen2_5_omni"]
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size":
              cfg.hidden_size, "patch_size": v["patch_size"], "spatial_merge_size": v["merge_size"],
              "temporal_patch_size": v["temporal_patch_size"], "fullatt_block_indexes": [1], "window_size": 56}
    frames = TINY_AUDIO["chunk_length"] * TINY_AUDIO["sampling_rate"] // TINY_AUDIO["hop_length"]
    audio = {"d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
             "num_mel_bins": TINY_AUDIO["feature_size"], "max_source_positions": frames // 2, "n_window": 50,
             "output_dim": cfg.hidden_size}
    config = Qwen2_5OmniThinkerConfig(text_config=text, vision_config=vision, audio_config=audio,
                                      audio_token_index=ids["audio"], image_token_index=ids["image"],
                                      video_token_index=ids["video"], audio_start_token_id=ids["audio_start"],
                                      audio_end_token_id=ids["audio_end"], vision_start_token_id=ids["vision_start"],
                                      tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2_5OmniThinkerForConditionalGeneration(config)


def build_tiny_qwen3_omni(cfg: TinyModelConfig, tokenizer: Any, *, seed: int = 0) -> Any:
    """A small ``Qwen3OmniMoeThinkerForConditionalGeneration``: a mixture-of-experts text model shaped by ``cfg``
    (4 experts, 2 per token), a 2-block vision tower of width 32 (patch 16, one deepstack layer) and a 2-layer audio
    encoder of width 32."""
    import torch
    from transformers import Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration

    ids = _ids(tokenizer)
    text = tiny_text_config(cfg, tokenizer)
    text.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": _mrope_section(cfg),
                                 "mrope_interleaved": True},
                head_dim=cfg.hidden_size // cfg.num_heads, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=cfg.intermediate_size // 2)
    v = TINY_OMNI_VISION["qwen3_omni"]
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size":
              cfg.hidden_size, "patch_size": v["patch_size"], "spatial_merge_size": v["merge_size"],
              "temporal_patch_size": v["temporal_patch_size"], "num_position_embeddings": 64,
              "deepstack_visual_indexes": [1]}
    audio = {"d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
             "num_mel_bins": TINY_AUDIO["feature_size"], "max_source_positions": 100, "n_window": 50,
             "n_window_infer": 100, "output_dim": cfg.hidden_size, "downsample_hidden_size": 16}
    config = Qwen3OmniMoeThinkerConfig(text_config=text, vision_config=vision, audio_config=audio,
                                       audio_token_id=ids["audio"], image_token_id=ids["image"],
                                       video_token_id=ids["video"], audio_start_token_id=ids["audio_start"],
                                       vision_start_token_id=ids["vision_start"], tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3OmniMoeThinkerForConditionalGeneration(config)


def tiny_omni_preprocessor(arch: str, tokenizer: Any) -> MultimodalPreprocessor:
    """Images, audios and videos for the tiny thinker of ``arch`` (``qwen2_5_omni`` or ``qwen3_omni``)."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from relax_hpc.data.video import VideoSettings

    v = TINY_OMNI_VISION[arch]
    ip = Qwen2VLImageProcessorPil(**v, **TINY_OMNI_PIXELS)
    video = VideoSettings(fps=2.0, min_frames=2, max_frames=8, **v, **TINY_OMNI_PIXELS)
    out_len = audio_out_len_qwen3_omni if arch == "qwen3_omni" else audio_out_len_qwen2
    return MultimodalPreprocessor(tokenizer, image_processor=ip, video=video, audio_out_len=out_len,
                                  feature_extractor=WhisperFeatureExtractor(**TINY_AUDIO),
                                  audio_in_video=audio_in_video(arch, tokenizer, None))


def audio_in_video(arch: str, tokenizer: Any, config: Any) -> AudioInVideo:
    """The ``use_audio_in_video`` layout of a thinker of ``arch`` (``qwen2_5_omni``/``qwen3_omni``), its timing from
    the thinker's ``config`` (None: the config class's defaults, as the tiny models use)."""
    ids = _ids(tokenizer)
    if config is None:
        from transformers import Qwen2_5OmniThinkerConfig

        config = Qwen2_5OmniThinkerConfig()  # 25 positions a second, 2 s chunks (Qwen3-Omni: the same rate)
    return AudioInVideo("merged" if arch == "qwen3_omni" else "chunked", ids["audio_start"], ids["audio_end"],
                        float(config.position_id_per_seconds), float(getattr(config, "seconds_per_chunk", 2.0) or 2.0))


def build_tiny_omni(cfg: TinyModelConfig, tokenizer: Any, *, seed: int = 0) -> Any:
    """The tiny thinker of ``cfg.arch``."""
    return (build_tiny_qwen3_omni if cfg.arch == "qwen3_omni" else build_tiny_qwen2_5_omni)(cfg, tokenizer, seed=seed)
