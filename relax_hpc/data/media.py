"""Images, audios and videos named by data rows: resolve the references, then decode them with well-kept libraries
(PIL for images; libsndfile through ``soundfile`` for WAV/FLAC/OGG/MP3 audio, FFmpeg through PyAV for any other
container and for video, see :mod:`relax_hpc.data.video`; resampling by FFmpeg's libswresample through PyAV).

A reference is a path (relative to the data file's folder), a dict with ``bytes`` (and/or ``path``) as HF
``datasets`` stores images and audios in Parquet, or for audio a dict with ``array`` and ``sampling_rate``.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.errors import UserError


class MediaError(UserError):
    """A media item that cannot be used (missing file, corrupt or truncated data, no frames, no samples): the row
    or sample is skipped and counted, the run goes on."""

MediaRef = Path | bytes | tuple[np.ndarray, int]
"""A resolved reference: a file, encoded bytes, or (decoded float32 samples, sampling rate)."""


def resolve_ref(ref: Any, base_dir: Path, origin: str, kind: str) -> MediaRef:
    """Check a row's media reference now (at load time) and normalise it."""
    if isinstance(ref, dict):
        if kind == "audio" and ref.get("array") is not None:
            return np.asarray(ref["array"], dtype=np.float32), int(ref["sampling_rate"])
        if ref.get("bytes"):
            return bytes(ref["bytes"])
        ref = ref.get("path")
    if not isinstance(ref, str) or not ref:
        raise UserError(f"{origin}: {kind} reference {ref!r} is neither a path nor a dict with 'bytes'")
    p = Path(ref).expanduser()
    p = p if p.is_absolute() else base_dir / p
    if not p.is_file():
        raise MediaError(f"{origin}: {kind} file {p} does not exist")
    return p


def open_media(ref: MediaRef) -> Any:
    return io.BytesIO(ref) if isinstance(ref, bytes) else ref


def load_image(ref: MediaRef) -> Any:
    """The image as an RGB ``PIL.Image``."""
    from PIL import Image

    try:
        with Image.open(open_media(ref)) as im:  # type: ignore[arg-type]
            return im.convert("RGB")
    except (OSError, ValueError, SyntaxError) as exc:
        raise MediaError(f"cannot read image {media_name(ref)}: {exc}") from None


def image_size(ref: MediaRef) -> tuple[int, int]:
    """(height, width) from the image header, without decoding the pixels."""
    from PIL import Image

    try:
        with Image.open(open_media(ref)) as im:  # type: ignore[arg-type]
            w, h = im.size
    except (OSError, ValueError, SyntaxError) as exc:
        raise MediaError(f"cannot read image {media_name(ref)}: {exc}") from None
    return h, w


def media_name(ref: MediaRef) -> str:
    return str(ref) if isinstance(ref, Path) else f"<{type(ref).__name__}>"


# ------------------------------------------------------------------------------------------------ audio
def _decode_soundfile(ref: Path | bytes) -> tuple[np.ndarray, int] | None:
    """(float32 [frames, channels], rate) through libsndfile, or None when it does not know the format."""
    import soundfile as sf

    try:
        x, rate = sf.read(open_media(ref), dtype="float32", always_2d=True)
    except sf.LibsndfileError:
        return None
    except (RuntimeError, TypeError, ValueError, OSError):
        return None
    return x, int(rate)


def _decode_av(ref: Path | bytes) -> tuple[np.ndarray, int]:
    """(float32 [frames, channels], rate) of the first audio stream through FFmpeg (PyAV)."""
    import av

    try:
        with av.open(open_media(ref) if isinstance(ref, bytes) else str(ref)) as container:  # type: ignore[arg-type]
            if not container.streams.audio:
                raise MediaError(f"{media_name(ref)} has no audio stream")
            stream = container.streams.audio[0]
            rate = int(stream.rate or stream.codec_context.sample_rate)
            chunks = []
            for frame in container.decode(stream):
                a = frame.to_ndarray().astype(np.float32)  # [channels, n] (planar) or [1, n * channels] (packed)
                channels = len(frame.layout.channels)
                chunks.append(a.reshape(channels, -1) if frame.format.is_planar else a.reshape(-1, channels).T)
    except av.FFmpegError as exc:
        raise MediaError(f"cannot decode audio {media_name(ref)}: {exc}") from None
    if not chunks:
        return np.zeros((0, 1), dtype=np.float32), rate
    return np.concatenate(chunks, axis=1).T, rate


def decode_audio(ref: MediaRef) -> tuple[np.ndarray, int]:
    """(float32 samples [frames, channels], native rate): libsndfile first (WAV/FLAC/OGG/MP3), FFmpeg for the rest."""
    if isinstance(ref, tuple):
        x = np.asarray(ref[0], dtype=np.float32)
        return (x.reshape(len(x), -1) if x.ndim > 1 else x[:, None]), int(ref[1])
    got = _decode_soundfile(ref)
    return got if got is not None else _decode_av(ref)


def resample(mono: np.ndarray, rate: int, sampling_rate: int) -> np.ndarray:
    """``mono`` float32 samples from ``rate`` to ``sampling_rate`` (FFmpeg's libswresample through PyAV)."""
    if rate == sampling_rate or mono.size == 0:
        return mono.astype(np.float32)
    import av

    resampler = av.AudioResampler(format="flt", layout="mono", rate=sampling_rate)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(mono, dtype=np.float32)[None, :], format="flt",
                                       layout="mono")
    frame.sample_rate = rate
    out = [f.to_ndarray() for f in resampler.resample(frame)] + [f.to_ndarray() for f in resampler.resample(None)]
    return np.concatenate(out, axis=1)[0].astype(np.float32) if out else np.zeros(0, dtype=np.float32)


def load_audio(ref: MediaRef, sampling_rate: int) -> np.ndarray:
    """Mono float32 samples at ``sampling_rate`` (channels averaged). An audio of zero length, or one that cannot
    be decoded, raises :class:`MediaError`."""
    x, rate = decode_audio(ref)
    if x.size == 0:
        raise MediaError(f"audio {media_name(ref)} has no samples")
    return resample(x.mean(axis=1), rate, sampling_rate)


def write_audio(path: Path | str, samples: np.ndarray, sampling_rate: int) -> None:
    """Write mono float samples in [-1, 1]; the format follows the suffix (.wav: 16-bit PCM, .flac, .ogg: Vorbis,
    .mp3) through libsndfile (for fixtures and the examples)."""
    import soundfile as sf

    suffix = Path(path).suffix.lower()
    subtype = {".wav": "PCM_16", ".flac": "PCM_16", ".ogg": "VORBIS", ".mp3": "MPEG_LAYER_III"}.get(suffix)
    if subtype is None:
        raise UserError(f"write_audio: unsupported suffix {suffix!r} (.wav, .flac, .ogg, .mp3)")
    sf.write(str(path), np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0), sampling_rate, subtype=subtype)


def write_wav(path: Path | str, samples: np.ndarray, sampling_rate: int) -> None:
    """Write mono float samples in [-1, 1] as a 16-bit PCM WAV (for fixtures and the examples)."""
    import soundfile as sf

    sf.write(str(path), np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0), sampling_rate, format="WAV",
             subtype="PCM_16")
