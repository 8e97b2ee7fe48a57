"""Omni thinkers: tiny Qwen2.5-Omni and Qwen3-Omni-MoE thinkers made from config (random weights, offline) and their
preprocessors (images, audios, videos); real ones load by path like any HF model
(``Qwen2_5OmniThinkerForConditionalGeneration`` / ``Qwen3OmniMoeThinkerForConditionalGeneration``).

The tiny models share the offline BPE tokenizer of :mod:`relax_hpc.models.multimodal`: images are
``<|vision_start|><|image_pad|><|vision_end|>``, videos ``<|vision_start|><|video_pad|><|vision_end|>``, audios
``<|audio_bos|><|AUDIO|><|audio_eos|>`` (the config's token ids point at these tokens). Their 3-D rotary positions
come from the model's own ``get_rope_index`` (see :mod:`relax_hpc.models.mrope`).
"""

from __future__ import annotations

from typing import Any

from relax_hpc.config.schema import TinyModelConfig
from relax_hpc.models.multimodal import (
    TINY_AUDIO,
    AudioInVideo,
    MultimodalPreprocessor,
    audio_out_len_qwen2,
    audio_out_len_qwen3_omni,
    tiny_text_config,
    token_id_of,
)

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
