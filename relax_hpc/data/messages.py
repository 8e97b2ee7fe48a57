"""Turn a row's prompt field into chat messages (or raw text), placing its images, audios and videos.

A prompt is a string (one user message) or a list of ``{"role": ..., "content": ...}`` messages. ``system_prompt``
becomes a leading system message unless the row already starts with one. A row with ``images``/``audios``/``videos``
needs one placeholder per item, in order: either ``<image>``/``<audio>``/``<video>`` markers inside the text, or none
at all, in which case all images, then all audios, then all videos go before the text of the first user message. In
chat messages they become typed content parts ``{"type": "image", "image": ref}`` (``audio``, ``video`` alike) that
Qwen-VL/Audio/Omni chat templates render as their placeholder tokens; in raw text they become the model's
placeholder string.
"""

from __future__ import annotations

import re
from typing import Any

from relax_hpc.errors import UserError

IMAGE_MARK = "<image>"
AUDIO_MARK = "<audio>"
VIDEO_MARK = "<video>"
KINDS = ("image", "audio", "video")
"""Media kinds, in the order unmarked items are placed before the text."""
_MARKS = re.compile(f"({re.escape(IMAGE_MARK)}|{re.escape(AUDIO_MARK)}|{re.escape(VIDEO_MARK)})")


def _parts(text: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for piece in _MARKS.split(text):
        kind = piece[1:-1] if _MARKS.fullmatch(piece) else None
        if kind is not None:
            out.append({"type": kind, kind: piece})
        elif piece:
            out.append({"type": "text", "text": piece})
    return out


def _count(messages: list[dict[str, Any]], kind: str) -> int:
    return sum(1 for m in messages if isinstance(m["content"], list) for p in m["content"]
               if isinstance(p, dict) and p.get("type") == kind)


def check_messages(prompt: Any, origin: str, key: str) -> list[dict[str, Any]]:
    """The prompt as a list of messages (a string becomes one user message); one UserError line if malformed."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise UserError(f"{origin}: field {key!r} must be a string or a non-empty list of chat messages, "
                        f"got {type(prompt).__name__}")
    out = []
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserError(f"{origin}: {key}[{i}] is not a chat message with 'role' and 'content'")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def build_messages(prompt: Any, *, system_prompt: str | None, num_images: int, num_audios: int, origin: str,
                   key: str, num_videos: int = 0) -> list[dict[str, Any]]:
    """Chat messages for one row, with media as typed content parts (see the module docstring)."""
    messages = check_messages(prompt, origin, key)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    want = {"image": num_images, "audio": num_audios, "video": num_videos}
    if not any(want.values()):
        return messages
    marked = any(isinstance(m["content"], str) and _MARKS.search(m["content"]) for m in messages)
    typed = sum(_count(messages, k) for k in KINDS) > 0
    if marked or typed:
        for m in messages:
            if isinstance(m["content"], str) and _MARKS.search(m["content"]):
                m["content"] = _parts(m["content"])
    else:
        user = next((m for m in messages if m["role"] == "user"), None)
        if user is None:
            raise UserError(f"{origin}: the row has images/audios but no user message to put them in")
        text = user["content"]
        rest = _parts(text) if isinstance(text, str) else list(text)
        user["content"] = [{"type": k, k: f"<{k}>"} for k in KINDS for _ in range(want[k])] + rest
    for m in messages:  # Qwen2-Audio's template looks for an 'audio' key, Qwen-VL's for type == 'image'
        if isinstance(m["content"], list):
            m["content"] = [{**p, p["type"]: p.get(p["type"], f"<{p['type']}>")}
                            if isinstance(p, dict) and p.get("type") in KINDS else p
                            for p in m["content"]]
    got = {k: _count(messages, k) for k in KINDS}
    if got != want:
        shown = [k for k in KINDS if k != "video" or got[k] or want[k]]
        have = " and ".join(f"{got[k]} {k}" for k in shown)
        need = " and ".join(f"{want[k]} {k}s" for k in shown)
        raise UserError(f"{origin}: the prompt has {have} placeholders but the row has {need}")
    return messages


def raw_text(prompt: Any, *, system_prompt: str | None, image_placeholder: str, audio_placeholder: str,
             num_images: int, num_audios: int, origin: str, key: str, num_videos: int = 0,
             video_placeholder: str = "") -> str:
    """The prompt as plain text (``chat_template: false``): the system prompt, a newline, the prompt; media
    markers replaced by the model's placeholder strings (or prepended when the text has none)."""
    if not isinstance(prompt, str):
        raise UserError(f"{origin}: field {key!r} holds chat messages, which need data.chat_template: true")
    text = prompt
    want = {IMAGE_MARK: num_images, AUDIO_MARK: num_audios, VIDEO_MARK: num_videos}
    if any(want.values()):
        got = {m: text.count(m) for m in want}
        if not any(got.values()):
            text = "".join(m * n for m, n in want.items()) + text
        elif got != want:
            raise UserError(f"{origin}: the prompt has {got[IMAGE_MARK]} {IMAGE_MARK}, {got[AUDIO_MARK]} "
                            f"{AUDIO_MARK} and {got[VIDEO_MARK]} {VIDEO_MARK} markers but the row has {num_images} "
                            f"images, {num_audios} audios and {num_videos} videos")
        text = (text.replace(IMAGE_MARK, image_placeholder).replace(AUDIO_MARK, audio_placeholder)
                .replace(VIDEO_MARK, video_placeholder))
    return text if system_prompt is None else f"{system_prompt}\n{text}"
