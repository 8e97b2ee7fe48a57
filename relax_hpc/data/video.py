"""Videos: frames decoded with PyAV (FFmpeg), sampled by fps within min/max frames, resized within min/max pixels
per frame and cut into the patches of a Qwen2-VL-family vision tower (Qwen2-VL, Qwen2.5-VL, Qwen2.5-Omni,
Qwen3-Omni), the same computation as transformers' ``Qwen2VLVideoProcessor`` (``do_sample_frames=True``,
``cap_pixels_per_frame=False``) step by step:

1. metadata from the stream header: ``total = stream.frames``, ``fps = stream.average_rate`` (as transformers'
   ``read_video_pyav``); a container without a frame count is counted by demuxing its packets;
2. ``n = floor(min(max(total / fps * sample_fps, min_frames), floor(min(max_frames, total) / tp) * tp, total) / tp)
   * tp`` frames at ``arange(0, total, total / n).int()`` (``tp`` = temporal patch size);
3. every frame resized to :func:`smart_resize` ``(h, w)`` (multiples of ``patch * merge``, pixels within
   ``[min_pixels, max_pixels]``) by bicubic interpolation with antialiasing on float32, clamped and rounded back to
   uint8 (what torchvision's ``resize`` does to uint8 tensors);
4. ``(x - 255 mean) / (255 std)`` in float32, the last frame repeated up to a multiple of ``tp``, patches laid out
   ``[t, h/m, w/m, m, m]`` x ``[C, tp, p, p]``.

Tensors of one prompt's videos::

    pixel_values_videos  float32 [sum of t*h*w, 3 * tp * p * p]
    video_grid_thw       int64   [num_videos, 3]
    second_per_grid_ts   float32 [num_videos]     tp / sample_fps (the processors' ``second_per_grid_ts``)

Qwen3-VL's video processor (``style="qwen3_vl"``, transformers' ``Qwen3VLVideoProcessor`` with
``cap_pixels_per_frame=False``) differs in three steps: ``n = min(max(int(total / fps * sample_fps), min_frames),
max_frames, total)`` frames at ``linspace(0, total - 1, n).round()``; the pixel budget ``[min_pixels, max_pixels]``
is for all frames together (``t * h * w``, its ``smart_resize``); and each temporal patch of frames gets a timestamp
in the prompt (:func:`timestamps`; the prompt layout is
:meth:`relax_hpc.models.multimodal.MultimodalPreprocessor.video_layout`). Its mean/std are 0.5 (set by the caller).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from relax_hpc.data.media import MediaError, MediaRef, media_name, open_media

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VideoSettings:
    """How videos become patches (defaults: Qwen2.5-VL's / Qwen2.5-Omni's video processor at 2 fps)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    style: Literal["qwen2_vl", "qwen3_vl"] = "qwen2_vl"
    """Whose video processor: Qwen2-VL's (Qwen2/2.5-VL, the Omni thinkers) or Qwen3-VL's (module docstring)."""

    @classmethod
    def of(cls, processor: Any, **overrides: Any) -> VideoSettings:
        """Settings from an HF video/image processor's attributes (``size`` or ``min/max_pixels``), then overrides
        (``None`` values ignored)."""
        size = getattr(processor, "size", None) or {}
        kw: dict[str, Any] = {}
        for name in ("patch_size", "merge_size", "temporal_patch_size", "min_frames", "max_frames", "fps"):
            v = getattr(processor, name, None)
            if v is not None:
                kw[name] = v
        lo = size.get("shortest_edge") if isinstance(size, dict) else getattr(size, "shortest_edge", None)
        hi = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
        if lo or getattr(processor, "min_pixels", None):
            kw["min_pixels"] = int(lo or processor.min_pixels)
        if hi or getattr(processor, "max_pixels", None):
            kw["max_pixels"] = int(hi or processor.max_pixels)
        for name in ("image_mean", "image_std"):
            v = getattr(processor, name, None)
            if v is not None:
                kw[name] = tuple(float(x) for x in v)
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)


@dataclass(frozen=True)
class VideoMeta:
    """What the header says about a video's first stream."""

    total_frames: int
    fps: float
    height: int
    width: int


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w): multiples of ``factor`` near the aspect ratio, ``h * w`` within [min_pixels, max_pixels] (Qwen2-VL)."""
    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"video aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_frames(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                        min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w) of Qwen3-VL's video frames: multiples of ``factor``, ``t * h * w`` within [min_pixels, max_pixels] for
    the ``num_frames`` frames together (rounded to ``temporal_factor``)."""
    if num_frames < temporal_factor:
        raise MediaError(f"the video has {num_frames} sampled frames, fewer than the temporal patch size "
                         f"{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"video aspect ratio {max(height, width) / min(height, width):.0f} is over 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_size(num_frames: int, height: int, width: int, s: VideoSettings) -> tuple[int, int]:
    """(h, w) the sampled frames are resized to, by the settings' style."""
    factor = s.patch_size * s.merge_size
    if s.style == "qwen3_vl":
        return smart_resize_frames(num_frames, height, width, s.temporal_patch_size, factor, s.min_pixels,
                                   s.max_pixels)
    return smart_resize(height, width, factor, s.min_pixels, s.max_pixels)


def timestamps(indices: np.ndarray, fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch of sampled frames (the mean of its first and last frame's time, the last
    index repeated up to a multiple of the patch size): Qwen3-VL's ``<t seconds>`` before each patch's tokens."""
    idx = [int(i) for i in indices]
    if pad := -len(idx) % temporal_patch_size:
        idx += [idx[-1]] * pad
    t = [i / fps for i in idx]
    return [(t[k] + t[k + temporal_patch_size - 1]) / 2 for k in range(0, len(t), temporal_patch_size)]


def _src(ref: MediaRef) -> Any:
    if isinstance(ref, tuple):
        raise MediaError("a video reference must be a file or encoded bytes")
    return open_media(ref) if isinstance(ref, bytes) else str(ref)


def probe(ref: MediaRef) -> VideoMeta:
    """The first video stream's frame count, rate and size, from the header (no frame is decoded)."""
    import av

    try:
        with av.open(_src(ref)) as c:
            if not c.streams.video:
                raise MediaError(f"{media_name(ref)} has no video stream")
            s = c.streams.video[0]
            total = int(s.frames)
            if total == 0:  # no count in the header: count the packets that carry a frame
                total = sum(1 for pkt in c.demux(s) if pkt.size)
            fps = float(s.average_rate) if s.average_rate else 0.0
            meta = VideoMeta(total, fps, int(s.height), int(s.width))
    except av.FFmpegError as exc:
        raise MediaError(f"cannot read video {media_name(ref)}: {exc}") from None
    if meta.total_frames <= 0:
        raise MediaError(f"video {media_name(ref)} has no frames")
    return meta


def has_audio(ref: MediaRef) -> bool:
    """Whether the video's container holds an audio stream (its track, for ``use_audio_in_video``; decoded by
    :func:`relax_hpc.data.media.load_audio`, which takes a container's first audio stream through PyAV)."""
    import av

    try:
        with av.open(_src(ref)) as c:
            return bool(c.streams.audio)
    except av.FFmpegError as exc:
        raise MediaError(f"cannot read video {media_name(ref)}: {exc}") from None


def sample_indices(meta: VideoMeta, s: VideoSettings) -> np.ndarray:
    """Indices of the frames to keep (step 2 of the module docstring)."""
    tp, total = s.temporal_patch_size, meta.total_frames
    if not meta.fps:
        raise MediaError("the video has no frame rate; cannot sample by fps")
    if s.style == "qwen3_vl":
        n3 = min(max(int(total / meta.fps * s.fps), s.min_frames), s.max_frames, total)
        return np.linspace(0, total - 1, n3).round().astype(int)
    max_frames = math.floor(min(s.max_frames, total) / tp) * tp
    n = min(max(total / meta.fps * s.fps, s.min_frames), max_frames, total)
    n = math.floor(n / tp) * tp
    if n <= 0:
        raise MediaError(f"the video has {total} frames, fewer than the temporal patch size {tp}")
    import torch

    return torch.arange(0, total, total / n).int().numpy()


def decode_frames(ref: MediaRef, indices: np.ndarray) -> np.ndarray:
    """uint8 RGB frames [len(indices), H, W, 3] at ``indices`` (decoding stops after the last one)."""
    import av

    want = {int(i): k for k, i in enumerate(indices)}
    last = int(max(want))
    out: list[np.ndarray | None] = [None] * len(indices)
    try:
        with av.open(_src(ref)) as c:
            for i, frame in enumerate(c.decode(video=0)):
                if i in want:
                    rgb = frame.to_ndarray(format="rgb24")
                    for k in np.flatnonzero(indices == i):
                        out[k] = rgb
                if i >= last:
                    break
    except av.FFmpegError as exc:
        raise MediaError(f"cannot decode video {media_name(ref)}: {exc}") from None
    got = [f for f in out if f is not None]
    if len(got) != len(out):
        raise MediaError(f"video {media_name(ref)} decoded {len(got)} of the {len(out)} frames its header promises")
    return np.stack(got)


def grid(meta: VideoMeta, s: VideoSettings) -> tuple[int, int, int]:
    """(t, h, w) patch grid of a video, from its header alone."""
    n = len(sample_indices(meta, s))
    h, w = frame_size(n, meta.height, meta.width, s)
    return -(-n // s.temporal_patch_size), h // s.patch_size, w // s.patch_size


def num_tokens(ref: MediaRef, s: VideoSettings) -> int:
    """Placeholder tokens of one video (``t * h * w / merge**2``), from the header alone."""
    t, h, w = grid(probe(ref), s)
    return t * h * w // s.merge_size**2


def frames_to_patches(frames: np.ndarray, s: VideoSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """uint8 frames [T, H, W, 3] -> (float32 patches [t*h*w, 3*tp*p*p], (t, h, w)) (steps 3 and 4)."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # [T, C, H, W] uint8
    rh, rw = frame_size(x.shape[0], x.shape[-2], x.shape[-1], s)
    if (rh, rw) != tuple(x.shape[-2:]):
        y = torch.nn.functional.interpolate(x.float(), size=(rh, rw), mode="bicubic", align_corners=False,
                                            antialias=True)
        x = y.clamp_(0, 255).round_().to(torch.uint8)
    mean = torch.tensor(s.image_mean, dtype=torch.float32).view(1, 3, 1, 1) * 255.0
    std = torch.tensor(s.image_std, dtype=torch.float32).view(1, 3, 1, 1) * 255.0
    v = (x.to(torch.float32) - mean) / std
    tp, p, m = s.temporal_patch_size, s.patch_size, s.merge_size
    if pad := -v.shape[0] % tp:
        v = torch.cat([v, v[-1:].expand(pad, -1, -1, -1)])
    t, c, gh, gw = v.shape[0] // tp, v.shape[1], rh // p, rw // p
    patches = v.view(t, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(t * gh * gw, c * tp * p * p).numpy(), (t, gh, gw)


def video_tensors(refs: list[MediaRef], s: VideoSettings) -> dict[str, np.ndarray]:
    """The named model inputs of a prompt's videos (see the module docstring)."""
    pv, grids = [], []
    for ref in refs:
        meta = probe(ref)
        frames = decode_frames(ref, sample_indices(meta, s))
        patches, g = frames_to_patches(frames, s)
        pv.append(patches)
        grids.append(g)
    return {"pixel_values_videos": np.concatenate(pv).astype(np.float32),
            "video_grid_thw": np.asarray(grids, dtype=np.int64),
            "second_per_grid_ts": np.full(len(refs), s.temporal_patch_size / s.fps, dtype=np.float32)}


def write_video(path: Path | str, frames: np.ndarray, fps: int, *, codec: str = "libx264",
                options: dict[str, str] | None = None, audio: tuple[np.ndarray, int] | None = None,
                audio_codec: str = "aac") -> None:
    """Write uint8 RGB frames [T, H, W, 3] as a video file with PyAV (for fixtures and the examples; ``libx264``
    with ``qp=0`` by default: lossless luma); ``audio``: (mono float samples in [-1, 1], rate), muxed as an audio
    track (``aac`` by default)."""
    import av

    frames = np.asarray(frames, dtype=np.uint8)
    with av.open(str(path), mode="w") as c:
        st = c.add_stream(codec, rate=fps)
        st.width, st.height = int(frames.shape[2]), int(frames.shape[1])
        st.pix_fmt = "yuv444p" if codec == "libx264" else "yuv420p"
        st.options = options if options is not None else ({"qp": "0"} if codec == "libx264" else {})
        ast = c.add_stream(audio_codec, rate=int(audio[1]), layout="mono") if audio is not None else None
        for f in frames:
            for pkt in st.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(pkt)
        for pkt in st.encode():
            c.mux(pkt)
        if ast is not None and audio is not None:
            _encode_audio(c, ast, np.clip(np.asarray(audio[0], dtype=np.float32), -1.0, 1.0), int(audio[1]))


def _encode_audio(c: Any, st: Any, samples: np.ndarray, rate: int) -> None:
    """Mux mono float samples into audio stream ``st`` of container ``c``, in frames of the encoder's size."""
    import av

    size = st.codec_context.frame_size or 1024
    fmt = st.codec_context.format.name  # the encoder's sample format (aac: planar float)
    resampler = av.AudioResampler(format=fmt, layout="mono", rate=rate)
    for start in range(0, len(samples), size):
        frame = av.AudioFrame.from_ndarray(samples[None, start:start + size], format="flt", layout="mono")
        frame.sample_rate, frame.pts = rate, start
        for out in resampler.resample(frame):
            for pkt in st.encode(out):
                c.mux(pkt)
    for pkt in st.encode(None):
        c.mux(pkt)
