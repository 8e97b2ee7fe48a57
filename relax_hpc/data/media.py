"""Images and audios named by data rows: resolve the references, then decode them (PIL for images, a small WAV reader
for audio, so no audio library is needed).

A reference is a path (relative to the data file's folder), a dict with ``bytes`` (and/or ``path``) as HF
``datasets`` stores images and audios in Parquet, or for audio a dict with ``array`` and ``sampling_rate``.
"""

from __future__ import annotations

import io
import struct
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.errors import UserError

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
        raise UserError(f"{origin}: {kind} file {p} does not exist")
    return p


def _open(ref: MediaRef) -> Any:
    return io.BytesIO(ref) if isinstance(ref, bytes) else ref


def load_image(ref: MediaRef) -> Any:
    """The image as an RGB ``PIL.Image``."""
    from PIL import Image

    try:
        with Image.open(_open(ref)) as im:  # type: ignore[arg-type]
            return im.convert("RGB")
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read image {_name(ref)}: {exc}") from None


def image_size(ref: MediaRef) -> tuple[int, int]:
    """(height, width) from the image header, without decoding the pixels."""
    from PIL import Image

    try:
        with Image.open(_open(ref)) as im:  # type: ignore[arg-type]
            w, h = im.size
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read image {_name(ref)}: {exc}") from None
    return h, w


def _name(ref: MediaRef) -> str:
    return str(ref) if isinstance(ref, Path) else f"<{type(ref).__name__}>"


# ------------------------------------------------------------------------------------------------ audio
def _decode_wav(data: bytes, name: str) -> tuple[np.ndarray, int]:
    """RIFF/WAVE with PCM (8/16/24/32-bit) or IEEE float (32/64-bit) samples -> (float32 [frames, channels], rate)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise UserError(f"{name} is not a WAV file (RIFF/WAVE)")
    fmt = None
    pos = 12
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        body = data[pos + 8:pos + 8 + size]
        if cid == b"fmt ":
            tag, channels, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
            if tag == 0xFFFE and len(body) >= 26:  # WAVE_FORMAT_EXTENSIBLE: the sub-format GUID starts with the tag
                tag = struct.unpack("<H", body[24:26])[0]
            fmt = (tag, channels, rate, bits)
        elif cid == b"data":
            if fmt is None:
                raise UserError(f"{name}: WAV data chunk before its fmt chunk")
            return _samples(body, *fmt, name=name), fmt[2]
        pos += 8 + size + (size & 1)
    raise UserError(f"{name}: WAV file without a data chunk")


def _samples(body: bytes, tag: int, channels: int, rate: int, bits: int, *, name: str) -> np.ndarray:
    width = bits // 8
    body = body[:len(body) - len(body) % (width * channels)]
    if tag == 3 and bits in (32, 64):
        x = np.frombuffer(body, dtype=f"<f{width}").astype(np.float32)
    elif tag == 1 and bits == 8:
        x = (np.frombuffer(body, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == 1 and bits in (16, 32):
        x = np.frombuffer(body, dtype=f"<i{width}").astype(np.float32) / float(2 ** (bits - 1))
    elif tag == 1 and bits == 24:
        b = np.frombuffer(body, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    else:
        raise UserError(f"{name}: unsupported WAV encoding (format {tag}, {bits} bits); use PCM or float WAV")
    return x.reshape(-1, channels)


def load_audio(ref: MediaRef, sampling_rate: int) -> np.ndarray:
    """Mono float32 samples at ``sampling_rate`` (channels averaged; resampled with scipy's polyphase filter when
    scipy is installed, else by linear interpolation)."""
    if isinstance(ref, tuple):
        x, rate = np.asarray(ref[0], dtype=np.float32), ref[1]
        x = x.reshape(len(x), -1) if x.ndim > 1 else x[:, None]
    else:
        data = ref if isinstance(ref, bytes) else Path(ref).read_bytes()
        x, rate = _decode_wav(data, _name(ref))
    mono = x.mean(axis=1)
    if rate == sampling_rate or mono.size == 0:
        return mono.astype(np.float32)
    try:
        from math import gcd

        from scipy.signal import resample_poly

        g = gcd(rate, sampling_rate)
        return resample_poly(mono, sampling_rate // g, rate // g).astype(np.float32)
    except ImportError:
        n = round(mono.size * sampling_rate / rate)
        return np.interp(np.arange(n) * (rate / sampling_rate), np.arange(mono.size), mono).astype(np.float32)


def write_wav(path: Path | str, samples: np.ndarray, sampling_rate: int) -> None:
    """Write mono float samples in [-1, 1] as a 16-bit PCM WAV (for fixtures and the examples)."""
    pcm = (np.clip(np.asarray(samples, dtype=np.float64), -1.0, 1.0) * 32767).astype("<i2").tobytes()
    header = struct.pack("<4sI4s4sIHHIIHH4sI", b"RIFF", 36 + len(pcm), b"WAVE", b"fmt ", 16, 1, 1, sampling_rate,
                         sampling_rate * 2, 2, 16, b"data", len(pcm))
    Path(path).write_bytes(header + pcm)
