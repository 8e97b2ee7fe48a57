"""The ``data`` section: where prompts come from, the built-in tasks and the media preprocessing."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from relax_hpc.config.base import Section


class TaskConfig(Section):
    """A built-in synthetic task that generates prompts and answers (the demo uses it; no files needed)."""

    name: Literal["reverse_digits", "sort_digits", "copy_digits"] = "reverse_digits"
    """Which task: reverse, sort or copy a string of digits."""
    min_len: int = Field(3, ge=1)
    """Shortest digit string."""
    max_len: int = Field(5, ge=1)
    """Longest digit string."""
    num_prompts: int = Field(2048, ge=1)
    """How many distinct prompts one epoch holds."""

    @model_validator(mode="after")
    def _lengths(self) -> TaskConfig:
        if self.min_len > self.max_len:
            raise ValueError(f"min_len={self.min_len} is larger than max_len={self.max_len}")
        return self


MEDIA_OPTION_KEYS = ("image_min_pixels", "image_max_pixels", "video_fps", "video_min_frames", "video_max_frames",
                     "video_min_pixels", "video_max_pixels", "use_audio_in_video")
"""The media knobs a data row may override for itself (its ``media_options`` field)."""


class MediaConfig(Section):
    """How images, audios and videos become model tensors, and where (inline, or a pool of worker processes). A knob
    left ``None`` keeps the model's processor default; a row's ``media_options`` field (a dict of the image/video
    knobs) overrides them for that row."""

    pool_size: int = Field(0, ge=0)
    """Worker processes that preprocess media (decode, resize, frame sampling, feature extraction), started once,
    each holding its processor; tensors come back through shared memory. 0: inline in the rollout process."""
    prefetch_batches: int = Field(2, ge=1)
    """Prompt batches the pool prepares ahead of the one the rollout takes (the bound of its queue)."""
    item_timeout_s: float = Field(300.0, gt=0)
    """Longest wait for one prompt's tensors before its worker counts as hung (restarted, the item retried once)."""
    image_min_pixels: int | None = Field(None, ge=1)
    """Fewest pixels an image is resized to (before patching)."""
    image_max_pixels: int | None = Field(None, ge=1)
    """Most pixels an image is resized to."""
    video_fps: float | None = Field(None, gt=0)
    """Frames sampled per second of video (default 2)."""
    video_min_frames: int | None = Field(None, ge=1)
    """Fewest frames sampled from a video (capped by its length)."""
    video_max_frames: int | None = Field(None, ge=1)
    """Most frames sampled from a video."""
    video_min_pixels: int | None = Field(None, ge=1)
    """Fewest pixels per video frame after resizing."""
    video_max_pixels: int | None = Field(None, ge=1)
    """Most pixels per video frame after resizing."""
    use_audio_in_video: bool | None = None
    """Omni thinkers (Qwen2.5-Omni, Qwen3-Omni): each video's audio track is decoded (PyAV), resampled to the
    feature extractor's rate and fed as the sample's audio, its tokens interleaved with the frames' as the model's
    processor lays them out (a video without an audio track stays silent). A row with videos and audios of its own
    cannot use it."""
    audio_sampling_rate: int | None = Field(None, ge=1000)
    """Rate audio is resampled to; must be the rate the model's feature extractor was built for (default: its
    own)."""
    options_key: str = "media_options"
    """Row field holding per-row overrides of the image/video knobs above (and ``use_audio_in_video``)."""

    def options(self) -> dict[str, Any]:
        """The image/video knobs that are set (``MEDIA_OPTION_KEYS``)."""
        return {k: getattr(self, k) for k in MEDIA_OPTION_KEYS if getattr(self, k) is not None}


class DataConfig(Section):
    """Where prompts come from."""

    path: str | None = None
    """JSONL, JSON or Parquet file, a folder of them, or a folder saved by HF ``datasets`` (``save_to_disk``). Relative
    paths are resolved against the recipe's folder. ``None`` uses ``task``."""
    task: TaskConfig | None = None
    """Built-in synthetic task, used when ``path`` is not set."""
    prompt_key: str = Field("prompt", min_length=1)
    """Field holding the prompt: a string, or a list of chat messages."""
    answer_key: str = Field("answer", min_length=1)
    """Field holding the reference answer given to the reward function."""
    system_prompt: str | None = None
    """Optional system message put before each prompt."""
    chat_template: bool = True
    """Apply the tokenizer's chat template (prompts become chat messages)."""
    max_prompt_tokens: int = Field(512, ge=1)
    """Prompts longer than this are skipped and counted (never truncated silently)."""
    shuffle: bool = True
    """Shuffle prompts each epoch, deterministically from ``seed``."""
    num_epochs: int = Field(1000, ge=1)
    """How many passes over the prompts at most (the run stops at ``num_steps`` first)."""
    media: MediaConfig = Field(default_factory=MediaConfig)
    """Media preprocessing (images, audios, videos): the processor pool and its knobs."""

    @model_validator(mode="after")
    def _source(self) -> DataConfig:
        if self.path is None and self.task is None:
            raise ValueError("data needs either `path` (a JSONL/Parquet file) or `task` (a built-in task)")
        return self
