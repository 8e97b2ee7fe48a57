"""Turn a row's prompt field into chat messages (or raw text), placing its images and audios.

A prompt is a string (one user message) or a list of ``{"role": ..., "content": ...}`` messages. ``system_prompt``
becomes a leading system message unless the row already starts with one. A row with ``images``/``audios`` needs one
placeholder per item, in order: either ``<image>``/``<audio>`` markers inside the text, or none at all, in which case
all images then all audios go before the text of the first user message. In chat messages they become typed content
parts ``{"type": "image", "image": ref}`` / ``{"type": "audio", "audio": ref}`` that Qwen-VL/Audio chat templates
render as their placeholder tokens; in raw text they become the model's placeholder string.
"""

from __future__ import annotations

import re
from typing import Any

from relax_hpc.errors import UserError

IMAGE_MARK = "<image>"
AUDIO_MARK = "<audio>"
_MARKS = re.compile(f"({re.escape(IMAGE_MARK)}|{re.escape(AUDIO_MARK)})")


def _parts(text: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for piece in _MARKS.split(text):
        if piece == IMAGE_MARK:
            out.append({"type": "image", "image": "<image>"})
        elif piece == AUDIO_MARK:
            out.append({"type": "audio", "audio": "<audio>"})
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
                   key: str) -> list[dict[str, Any]]:
    """Chat messages for one row, with media as typed content parts (see the module docstring)."""
    messages = check_messages(prompt, origin, key)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if not num_images and not num_audios:
        return messages
    marked = any(isinstance(m["content"], str) and _MARKS.search(m["content"]) for m in messages)
    typed = _count(messages, "image") + _count(messages, "audio") > 0
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
        user["content"] = ([{"type": "image", "image": "<image>"}] * num_images
                           + [{"type": "audio", "audio": "<audio>"}] * num_audios + rest)
    for m in messages:  # Qwen2-Audio's template looks for an 'audio' key, Qwen-VL's for type == 'image'
        if isinstance(m["content"], list):
            m["content"] = [{**p, p["type"]: p.get(p["type"], f"<{p['type']}>")}
                            if isinstance(p, dict) and p.get("type") in ("image", "audio") else p
                            for p in m["content"]]
    got_i, got_a = _count(messages, "image"), _count(messages, "audio")
    if (got_i, got_a) != (num_images, num_audios):
        raise UserError(f"{origin}: the prompt has {got_i} image and {got_a} audio placeholders but the row has "
                        f"{num_images} images and {num_audios} audios")
    return messages


def raw_text(prompt: Any, *, system_prompt: str | None, image_placeholder: str, audio_placeholder: str,
             num_images: int, num_audios: int, origin: str, key: str) -> str:
    """The prompt as plain text (``chat_template: false``): the system prompt, a newline, the prompt; media
    markers replaced by the model's placeholder strings (or prepended when the text has none)."""
    if not isinstance(prompt, str):
        raise UserError(f"{origin}: field {key!r} holds chat messages, which need data.chat_template: true")
    text = prompt
    if num_images or num_audios:
        n_i, n_a = text.count(IMAGE_MARK), text.count(AUDIO_MARK)
        if n_i == n_a == 0:
            text = IMAGE_MARK * num_images + AUDIO_MARK * num_audios + text
        elif (n_i, n_a) != (num_images, num_audios):
            raise UserError(f"{origin}: the prompt has {n_i} {IMAGE_MARK} and {n_a} {AUDIO_MARK} markers but the "
                            f"row has {num_images} images and {num_audios} audios")
        text = text.replace(IMAGE_MARK, image_placeholder).replace(AUDIO_MARK, audio_placeholder)
    return text if system_prompt is None else f"{system_prompt}\n{text}"
