"""Multimodal models: tiny Qwen2.5-VL and Qwen2-Audio made from config (random weights, offline), an offline
byte-level BPE tokenizer with their special tokens, and the prompt-side preprocessing that turns a prompt's images
and audios into the named tensors the sample store carries.

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

from typing import Any

import numpy as np

from relax_hpc.config.schema import ModelConfig, TinyModelConfig
from relax_hpc.data.media import MediaRef, image_size, load_audio, load_image
from relax_hpc.errors import ConfigError, UserError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>", "<|audio_bos|>", "<|audio_eos|>", "<|AUDIO|>"]
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
AUDIO_PLACEHOLDER = "<|audio_bos|><|AUDIO|><|audio_eos|>"
# Qwen-style ChatML; string contents or typed parts (text / image / audio), as the Qwen2.5-VL and Qwen2-Audio
# templates render them.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}" + IMAGE_PLACEHOLDER + "{% elif p['type'] == 'audio' %}" + AUDIO_PLACEHOLDER +
    "{% elif 'text' in p %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = ("What is 12 plus 30? The answer is 42. Describe the image. What do you hear in the audio? "
           "Reason step by step, then put the final answer in \\boxed{}. 0123456789 +-*/=(). ")

TINY_IMAGE = {"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 28 * 28,
              "max_pixels": 28 * 28 * 16}
"""Image processor of the tiny VL model: images become at most 4x4 merged tokens."""
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


def _token_id(tokenizer: Any, token: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if tid is None or tid == tokenizer.unk_token_id:
        raise ConfigError(f"the tokenizer has no {token} token (needed for multimodal prompts)")
    return int(tid)


class MultimodalPreprocessor:
    """Images/audios of one prompt -> model tensors, and the matching expansion of the placeholder tokens."""

    def __init__(self, tokenizer: Any, *, image_processor: Any = None, feature_extractor: Any = None,
                 image_token: str = "<|image_pad|>", audio_token: str = "<|AUDIO|>"):
        self.image_processor = image_processor
        self.feature_extractor = feature_extractor
        self.image_token_id = _token_id(tokenizer, image_token) if image_processor is not None else None
        self.audio_token_id = _token_id(tokenizer, audio_token) if feature_extractor is not None else None
        self.image_placeholder = IMAGE_PLACEHOLDER
        self.audio_placeholder = AUDIO_PLACEHOLDER

    def _need(self, kind: str) -> None:
        if (self.image_processor if kind == "image" else self.feature_extractor) is None:
            raise UserError(f"the data has {kind}s but the model takes no {kind} input")

    # -------------------------------------------------------------------------------------------- token counts
    def image_tokens(self, ref: MediaRef) -> int:
        """Placeholder tokens of one image, from its header only (no decoding)."""
        self._need("image")
        h, w = image_size(ref)
        merge = int(self.image_processor.merge_size)
        return int(self.image_processor.get_number_of_image_patches(h, w)) // merge**2

    def _audio_frames(self, num_samples: int) -> int:
        fe = self.feature_extractor
        return min(-(-min(num_samples, fe.n_samples) // fe.hop_length), fe.nb_max_frames)

    @staticmethod
    def _audio_out_len(frames: np.ndarray | int) -> Any:
        return (((frames - 1) // 2 + 1) - 2) // 2 + 1

    def audio_tokens(self, ref: MediaRef) -> int:
        """Placeholder tokens of one audio (its length after the encoder's convolutions and pooling)."""
        self._need("audio")
        samples = load_audio(ref, self.feature_extractor.sampling_rate)
        return int(self._audio_out_len(self._audio_frames(samples.size)))

    def expand(self, ids: list[int], image_counts: list[int], audio_counts: list[int], origin: str) -> list[int]:
        """``ids`` with the i-th image (audio) placeholder token repeated ``image_counts[i]`` (``audio_counts[i]``)
        times. The number of placeholders must equal the number of items."""
        todo: dict[int, list[int]] = {}
        if image_counts:
            self._need("image")
            todo[self.image_token_id] = list(image_counts)  # type: ignore[index]
        if audio_counts:
            self._need("audio")
            todo[self.audio_token_id] = list(audio_counts)  # type: ignore[index]
        seen = dict.fromkeys(todo, 0)
        out: list[int] = []
        for t in ids:
            if t in todo:
                counts = todo[t]
                if seen[t] < len(counts):
                    out.extend([t] * counts[seen[t]])
                seen[t] += 1
            else:
                out.append(t)
        for t, counts in todo.items():
            if seen[t] != len(counts):
                raise UserError(f"{origin}: the tokenized prompt has {seen[t]} placeholder tokens {t} for "
                                f"{len(counts)} {'images' if t == self.image_token_id else 'audios'} (does the chat "
                                "template render image/audio content parts?)")
        return out

    # -------------------------------------------------------------------------------------------- tensors
    def tensors(self, images: list[MediaRef], audios: list[MediaRef]) -> dict[str, np.ndarray]:
        """The named model inputs of a prompt's media (see the module docstring)."""
        out: dict[str, np.ndarray] = {}
        if images:
            self._need("image")
            feats = self.image_processor([load_image(r) for r in images], return_tensors="np")
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
        return out

    def token_counts(self, tensors: dict[str, np.ndarray]) -> tuple[list[int], list[int]]:
        """Placeholder tokens per image and per audio implied by ``tensors`` (to check :meth:`expand`)."""
        img: list[int] = []
        aud: list[int] = []
        if "image_grid_thw" in tensors:
            merge = int(self.image_processor.merge_size)
            img = [int(n) // merge**2 for n in tensors["image_grid_thw"].prod(axis=-1)]
        if "feature_attention_mask" in tensors:
            aud = [int(n) for n in self._audio_out_len(tensors["feature_attention_mask"].sum(axis=-1))]
        return img, aud


# ------------------------------------------------------------------------------------------------ factories
def tiny_preprocessor(arch: str, tokenizer: Any) -> MultimodalPreprocessor | None:
    """The preprocessor of a tiny model of ``arch`` (None for the text-only ``qwen3``)."""
    if arch == "qwen2_5_vl":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return MultimodalPreprocessor(tokenizer, image_processor=Qwen2VLImageProcessorPil(**TINY_IMAGE))
    if arch == "qwen2_audio":
        from transformers import WhisperFeatureExtractor

        return MultimodalPreprocessor(tokenizer, feature_extractor=WhisperFeatureExtractor(**TINY_AUDIO))
    return None


def build_preprocessor(cfg: ModelConfig, tokenizer: Any) -> MultimodalPreprocessor | None:
    """The preprocessor for the recipe's model: by ``tiny.arch`` for ``tiny``, else by the ``model_type`` of the
    model's config (Qwen2/2.5-VL: its image processor; Qwen2-Audio: its feature extractor; others: None)."""
    if cfg.path == "tiny":
        return tiny_preprocessor(cfg.tiny.arch, tokenizer)
    from transformers import AutoConfig

    try:
        model_type = AutoConfig.from_pretrained(cfg.path, trust_remote_code=cfg.trust_remote_code).model_type
    except OSError as exc:
        raise UserError(f"model.path: cannot read the config of {cfg.path!r}: {str(exc).splitlines()[0]}") from exc
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return MultimodalPreprocessor(tokenizer, image_processor=Qwen2VLImageProcessorPil.from_pretrained(cfg.path))
    if model_type == "qwen2_audio":
        from transformers import WhisperFeatureExtractor

        return MultimodalPreprocessor(tokenizer, feature_extractor=WhisperFeatureExtractor.from_pretrained(cfg.path))
    return None


def _text_config(cfg: TinyModelConfig, tokenizer: Any) -> dict[str, Any]:
    if cfg.hidden_size % cfg.num_heads:
        raise ConfigError(f"model.tiny.hidden_size={cfg.hidden_size} is not divisible by num_heads={cfg.num_heads}")
    return {"vocab_size": len(tokenizer), "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "max_position_embeddings": cfg.max_position,
            "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id}


def build_tiny_vl_model(cfg: TinyModelConfig, tokenizer: Any, *, seed: int = 0) -> Any:
    """A small ``Qwen2_5_VLForConditionalGeneration`` with random weights: the text model shaped by ``cfg``, a
    2-block vision tower of width 32 (patch 14, merge 2) matching :data:`TINY_IMAGE`."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = _text_config(cfg, tokenizer)
    half = cfg.hidden_size // cfg.num_heads // 2  # rotary frequencies per head, split over (t, h, w)
    t = max(1, half // 4)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6,
                               "mrope_section": [t, (half - t) // 2, half - t - (half - t) // 2]}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size":
              cfg.hidden_size, "patch_size": TINY_IMAGE["patch_size"], "spatial_merge_size": TINY_IMAGE["merge_size"],
              "temporal_patch_size": TINY_IMAGE["temporal_patch_size"], "fullatt_block_indexes": [1]}
    ids = {k: _token_id(tokenizer, tok) for k, tok in (("image_token_id", "<|image_pad|>"),
                                                        ("video_token_id", "<|video_pad|>"),
                                                        ("vision_start_token_id", "<|vision_start|>"),
                                                        ("vision_end_token_id", "<|vision_end|>"))}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2_5_VLForConditionalGeneration(config)


def build_tiny_audio_model(cfg: TinyModelConfig, tokenizer: Any, *, seed: int = 0) -> Any:
    """A small ``Qwen2AudioForConditionalGeneration`` with random weights: the text model shaped by ``cfg``, a
    2-layer audio encoder of width 32 taking :data:`TINY_AUDIO` features (100 frames of 16 mel bins)."""
    import torch
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    text = {"model_type": "qwen2", **_text_config(cfg, tokenizer)}
    frames = TINY_AUDIO["chunk_length"] * TINY_AUDIO["sampling_rate"] // TINY_AUDIO["hop_length"]
    audio = {"model_type": "qwen2_audio_encoder", "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2,
             "encoder_ffn_dim": 64, "num_mel_bins": TINY_AUDIO["feature_size"], "max_source_positions": frames // 2}
    config = Qwen2AudioConfig(audio_config=audio, text_config=text,
                              audio_token_index=_token_id(tokenizer, "<|AUDIO|>"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2AudioForConditionalGeneration(config)


def build_tiny_multimodal_model(cfg: TinyModelConfig, tokenizer: Any, *, seed: int = 0) -> Any:
    """The tiny model of ``cfg.arch`` (``qwen2_5_vl`` or ``qwen2_audio``)."""
    if cfg.arch == "qwen2_5_vl":
        return build_tiny_vl_model(cfg, tokenizer, seed=seed)
    if cfg.arch == "qwen2_audio":
        return build_tiny_audio_model(cfg, tokenizer, seed=seed)
    raise ConfigError(f"model.tiny.arch={cfg.arch!r} is not multimodal (use relax_hpc.models.tiny for qwen3)")
