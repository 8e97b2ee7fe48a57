"""A prompt's raw media as the fields an inference server takes (the trainer still gets the processor's tensors).

Every item becomes a ``data:`` URL (base64 of the file's bytes), which both servers decode themselves and which needs
no shared path between the rollout node and the server: SGLang's ``/generate`` takes them as ``image_data``,
``audio_data`` and ``video_data`` (lists, one entry per item, in prompt order); vLLM's token-in/token-out
``/inference/v1/generate`` as ``content_parts`` (``{"type": "image_url" | "audio_url" | "video_url", "url": ...}``),
from which it builds the ``multi_modal_data`` of a ``TokensPrompt``. Decoded audio (samples, sampling rate) is
written as 16-bit WAV by libsndfile (``soundfile``).

The server expands each item's placeholder itself, so it gets the prompt's compact token ids
(:attr:`relax_hpc.rollout.engine.GenerateRequest.engine_prompt_ids`, one placeholder per item), not the expanded
stream the trainer trains on.
"""

from __future__ import annotations

import base64
import io
import mimetypes
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

KINDS = ("image", "audio", "video")
DEFAULT_MIME = {"image": "image/png", "audio": "audio/wav", "video": "video/mp4"}
_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
          (b"RIFF", "audio/wav"), (b"fLaC", "audio/flac"), (b"OggS", "audio/ogg"), (b"ID3", "audio/mpeg"),
          (b"\x1aE\xdf\xa3", "video/webm"))


def data_url(ref: Any, kind: str) -> str:
    """One media reference (a path, encoded bytes, or for audio ``(float32 samples, sampling rate)``) as a
    ``data:<mime>;base64,...`` URL."""
    if isinstance(ref, tuple):
        data, mime = _wav(ref), "audio/wav"
    elif isinstance(ref, (bytes, bytearray, memoryview)):
        data = bytes(ref)
        mime = _sniff(data, kind)
    else:
        path = Path(ref)
        data = path.read_bytes()
        mime = mimetypes.guess_type(path.name)[0] or _sniff(data, kind)
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _sniff(data: bytes, kind: str) -> str:
    if data[4:8] == b"ftyp":
        return "video/mp4"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for magic, mime in _MAGIC:
        if data.startswith(magic):
            return mime
    return DEFAULT_MIME[kind]


def _wav(ref: tuple[Any, int]) -> bytes:
    import numpy as np
    import soundfile

    samples, rate = ref
    buf = io.BytesIO()
    soundfile.write(buf, np.asarray(samples, dtype=np.float32), int(rate), format="WAV", subtype="PCM_16")
    return buf.getvalue()


def _items(media: Mapping[str, Sequence[Any]] | None) -> list[tuple[str, list[str]]]:
    if not media:
        return []
    unknown = set(media) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown media kinds {sorted(unknown)} (known: {', '.join(KINDS)})")
    return [(k, [data_url(r, k) for r in media[k]]) for k in KINDS if media.get(k)]


def sglang_fields(media: Mapping[str, Sequence[Any]] | None) -> dict[str, list[str]]:
    """``{"image_data": [...], "audio_data": [...], "video_data": [...]}`` (only the kinds present)."""
    return {f"{kind}_data": urls for kind, urls in _items(media)}


def vllm_content_parts(media: Mapping[str, Sequence[Any]] | None) -> list[dict[str, str]]:
    """``[{"type": "image_url", "url": ...}, ...]``: images, then audios, then videos (each in prompt order)."""
    return [{"type": f"{kind}_url", "url": url} for kind, urls in _items(media) for url in urls]
