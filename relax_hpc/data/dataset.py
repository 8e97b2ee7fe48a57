"""Prompts, tokenized once: a built-in task or files (JSONL/Parquet/a folder), filtered by length, never truncated.

Each row's ``prompt_key`` (a string or chat messages) becomes token ids: through the tokenizer's chat template with
a generation prompt (``chat_template: true``; ``system_prompt`` first), or as raw text. A row may name ``images``
, ``audios`` and/or ``videos`` (see :mod:`relax_hpc.data.messages` for the placeholders); their placeholder tokens
are expanded to the model's count at load time, so lengths are exact, and their tensors are made when a prompt is
taken. Prompts longer than ``max_prompt_tokens`` are skipped and counted (one warning); so are rows whose media
cannot be used (missing file, corrupt or truncated data, a video without frames, an audio of zero length: one warning
naming the first), and a prompt whose media fails when it is taken (:class:`~relax_hpc.data.media.MediaError`; the
stream skips it with one log line and counts it). ``meta`` holds the row's other
fields plus ``index`` (position in the dataset) and ``source`` (``file:line`` or ``task``). ``prompt_key`` and
``answer_key`` may be dotted paths into nested fields (``reward_model.ground_truth``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_hpc.config.schema import DataConfig
from relax_hpc.data.media import MediaError, MediaRef, resolve_ref
from relax_hpc.data.messages import build_messages, raw_text
from relax_hpc.data.sources import Row, read_rows
from relax_hpc.data.tasks import generate_task
from relax_hpc.errors import ConfigError, UserError

log = logging.getLogger(__name__)

MEDIA_KEYS = {"image": "images", "audio": "audios", "video": "videos"}
_CHUNK = 512


@dataclass
class Prompt:
    """One prompt for rollout."""

    prompt_ids: list[int]
    """Token ids, chat template and expanded media placeholders included."""
    answer: Any
    """The reference answer handed to the reward function."""
    meta: dict[str, Any] = field(default_factory=dict)
    """The row's other fields, ``index``, ``source``, and ``epoch`` when it came from a :class:`PromptStream`."""
    multimodal: dict[str, np.ndarray] | None = None
    """Named model inputs of the prompt's images/audios/videos (``pixel_values``, ``image_grid_thw``,
    ``input_features``, ``feature_attention_mask``, ``pixel_values_videos``, ``video_grid_thw``,
    ``second_per_grid_ts``), or None for a text prompt."""
    engine_prompt_ids: list[int] | None = None
    """For a prompt with media: its token ids with one placeholder token per item (not expanded), the token stream
    server engines take beside ``media``; ``prompt_ids`` is the expanded stream the trainer trains on."""
    media: dict[str, list[Any]] | None = None
    """The resolved media references by kind (``image``/``audio``/``video``: paths or bytes), for engines that take
    raw media (server engines) and for preprocessing elsewhere (the processor pool)."""
    raw: Any = None
    """The row's prompt field as it is in the data (a string or chat messages): a multi-turn environment's
    ``reset`` gets it."""


@dataclass
class _Record:
    ids: list[int]
    answer: Any
    meta: dict[str, Any]
    images: list[MediaRef]
    audios: list[MediaRef]
    videos: list[MediaRef] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    """Media knobs of this row (``data.media`` then the row's own ``media_options``)."""
    counts: tuple[list[int], list[int], list[int]] = ([], [], [])
    """Placeholder tokens per image, per audio and per video."""
    engine_ids: list[int] | None = None
    """The prompt's ids with one placeholder per item, kept where the expansion is not plain runs (videos with
    their audio, Qwen3-VL's timestamps); otherwise made from ``ids`` (``MultimodalPreprocessor.compact``)."""
    video_audio: list[int | None] | None = None
    """``use_audio_in_video``: per video, the index of its audio track in ``audios`` (None: a silent video)."""

    raw: Any = None
    """The row's prompt field as it is in the data."""

    @property
    def has_media(self) -> bool:
        return bool(self.images or self.audios or self.videos)


def row_field(row: Row, key: str, setting: str) -> Any:
    """``row[key]``; a dotted key (``reward_model.ground_truth``) that is not a field itself walks nested dicts."""
    if key in row.fields:
        return row.fields[key]
    node: Any = row.fields
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise UserError(f"{row.origin}: no field {key!r} ({setting}); fields: {sorted(row.fields)}")
        node = node[part]
    return node


class PromptDataset:
    """The prompts of a :class:`DataConfig`, tokenized and length-filtered at construction.

    ``multimodal`` (a :class:`relax_hpc.models.multimodal.MultimodalPreprocessor`) is needed only when rows have
    ``images`` or ``audios``.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any, seed: int, *, multimodal: Any = None):
        self.cfg = cfg
        self.seed = seed
        self.tokenizer = tokenizer
        self.multimodal = multimodal
        self._pre: dict[tuple[Any, ...], Any] = {}
        if cfg.path is not None:
            rows = read_rows(cfg.path)
            where = cfg.path
        else:
            assert cfg.task is not None  # DataConfig's validator ensures one source
            rows = [Row(r, f"task {cfg.task.name}#{i}", None) for i, r in enumerate(generate_task(cfg.task, seed))]
            where = f"task {cfg.task.name}"
        if not rows:
            raise UserError(f"data: {where} holds no rows")
        if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
            raise ConfigError("data.chat_template is true but the tokenizer has no chat template; "
                              "set data.chat_template: false to tokenize raw text")
        self.num_rows = len(rows)
        self._records: list[_Record] = []
        self.num_too_long = 0
        self.num_bad_media = 0
        self._first_bad: str | None = None
        longest = 0
        for start in range(0, len(rows), _CHUNK):
            for rec in self._tokenize(rows[start:start + _CHUNK]):
                if len(rec.ids) > cfg.max_prompt_tokens:
                    self.num_too_long += 1
                    longest = max(longest, len(rec.ids))
                    continue
                rec.meta["index"] = len(self._records)
                self._records.append(rec)
        if self.num_too_long:
            log.warning("data: skipped %d of %d prompts longer than data.max_prompt_tokens=%d (longest: %d tokens)",
                        self.num_too_long, self.num_rows, cfg.max_prompt_tokens, longest)
        if self.num_bad_media:
            log.warning("data: skipped %d of %d rows whose media cannot be used (first: %s)", self.num_bad_media,
                        self.num_rows, self._first_bad)
        if not self._records and not self.num_bad_media:
            raise UserError(f"data: all {self.num_rows} prompts of {where} are longer than "
                            f"data.max_prompt_tokens={cfg.max_prompt_tokens}")
        if not self._records:
            raise UserError(f"data: none of the {self.num_rows} prompts of {where} is usable ({self.num_too_long} "
                            f"longer than data.max_prompt_tokens={cfg.max_prompt_tokens}, {self.num_bad_media} with "
                            f"unusable media, first: {self._first_bad})")

    # ------------------------------------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: int) -> Prompt:
        """Prompt ``i`` (its media tensors are made now; :class:`MediaError` if they cannot be)."""
        p = self.prompt(i, tensors=False)
        if p.media:
            p.multimodal = self.make_tensors(i)
        return p

    def prompt(self, i: int, *, tensors: bool = True) -> Prompt:
        """Prompt ``i``; with ``tensors=False`` its media stay references (``media``), for a processor pool."""
        if tensors:
            return self[i]
        rec = self._records[i]
        media = ({k: list(getattr(rec, MEDIA_KEYS[k])) for k in MEDIA_KEYS if getattr(rec, MEDIA_KEYS[k])}
                 if rec.has_media else None)
        meta = dict(rec.meta)
        if rec.options:
            meta["media_options"] = dict(rec.options)
        engine_ids = (rec.engine_ids or self.multimodal.compact(rec.ids)) if media else None
        return Prompt(list(rec.ids), rec.answer, meta, None, engine_prompt_ids=engine_ids, media=media, raw=rec.raw)

    def preprocessor(self, options: dict[str, Any]) -> Any:
        """The preprocessor with ``options`` applied (cached per distinct options)."""
        key = tuple(sorted(options.items()))
        if key not in self._pre:
            self._pre[key] = self.multimodal.with_options(options)
        return self._pre[key]

    def expected_counts(self, i: int) -> tuple[list[int], list[int], list[int]]:
        """Placeholder tokens per image, audio and video of prompt ``i``, as expanded at load time."""
        return self._records[i].counts

    def make_tensors(self, i: int) -> dict[str, np.ndarray]:
        """The media tensors of prompt ``i`` (checked against the token counts expanded at load time)."""
        rec = self._records[i]
        pre = self.preprocessor(rec.options)
        mm = pre.tensors(rec.images, rec.audios, rec.videos)
        counts = pre.token_counts(mm)
        if counts != rec.counts:
            raise MediaError(f"{rec.meta['source']}: its media changed since the data was loaded (placeholder "
                             f"tokens {counts} != {rec.counts})")
        return mm

    def stats(self) -> dict[str, int]:
        """``data/rows``, ``data/prompts``, ``data/too_long`` and ``data/bad_media`` (skipped) counts."""
        return {"data/rows": self.num_rows, "data/prompts": len(self), "data/too_long": self.num_too_long,
                "data/bad_media": self.num_bad_media}

    # ------------------------------------------------------------------------------------------------ building
    def _options(self, row: Row) -> dict[str, Any]:
        key = self.cfg.media.options_key
        own = row.fields.get(key) or {}
        if not isinstance(own, dict):
            raise UserError(f"{row.origin}: field {key!r} must be a dict of media options, got {type(own).__name__}")
        return {**self.cfg.media.options(), **own}

    def _bad(self, origin: str, exc: MediaError) -> None:
        self.num_bad_media += 1
        if self._first_bad is None:
            msg = str(exc)
            self._first_bad = msg if msg.startswith(origin) else f"{origin}: {msg}"

    def _media(self, row: Row, kind: str) -> list[MediaRef]:
        refs = row.fields.get(MEDIA_KEYS[kind])
        if refs is None:
            return []
        if not isinstance(refs, list):
            refs = [refs]
        if refs and self.multimodal is None:
            raise UserError(f"{row.origin}: the row has {MEDIA_KEYS[kind]} but the model is text-only "
                            "(use a Qwen2.5-VL / Qwen2-Audio / Qwen-Omni model)")
        assert row.base_dir is not None
        return [resolve_ref(r, row.base_dir, row.origin, kind) for r in refs]

    def _tokenize(self, rows: list[Row]) -> list[_Record]:
        cfg = self.cfg
        recs = []
        prompts = []
        kept = []
        for row in rows:
            prompt = row_field(row, cfg.prompt_key, "data.prompt_key")
            answer = row_field(row, cfg.answer_key, "data.answer_key")
            skip = {cfg.prompt_key, cfg.answer_key, cfg.media.options_key, *MEDIA_KEYS.values()}
            meta = {k: v for k, v in row.fields.items() if k not in skip}
            meta["source"] = row.origin
            try:
                rec = _Record([], answer, meta, *(self._media(row, k) for k in MEDIA_KEYS), raw=prompt)
                if rec.has_media:
                    rec.options = self._options(row)
                    pre = self.preprocessor(rec.options)
                    if pre.use_audio_in_video and rec.videos:
                        self._audio_from_videos(row, rec)
                    rec.counts = tuple([pre.count(k, r) for r in getattr(rec, MEDIA_KEYS[k])]  # type: ignore
                                       for k in MEDIA_KEYS)
            except MediaError as exc:
                self._bad(row.origin, exc)
                continue
            prompts.append(prompt)
            recs.append(rec)
            kept.append(row)
        if not recs:
            return recs
        texts = [self._render(p, row, rec) for p, row, rec in zip(prompts, kept, recs, strict=True)]
        for row, rec, ids in zip(kept, recs, self._encode(kept, texts), strict=True):
            if rec.has_media:
                img, aud, vid = rec.counts
                pre = self.preprocessor(rec.options)
                layouts = pre.video_layouts(rec.videos, rec.video_audio, aud) if rec.videos else None
                if layouts is not None:  # the prompt as a server engine takes it: one placeholder per item
                    rec.engine_ids = pre.compact(ids)
                if rec.video_audio is not None:  # a video's audio tokens are in its layout: no audio placeholders
                    aud = []
                ids = pre.expand(ids, img, aud, row.origin, video_counts=vid, video_layouts=layouts)
            rec.ids = ids
        return recs

    def _audio_from_videos(self, row: Row, rec: _Record) -> None:
        """``use_audio_in_video``: the row's audios become its videos' audio tracks (a silent video has none)."""
        from relax_hpc.data.video import has_audio

        if rec.audios:
            raise UserError(f"{row.origin}: use_audio_in_video takes the audio of the row's videos; the row has "
                            f"{len(rec.audios)} audios of its own as well (drop them, or the option for this row)")
        rec.video_audio, rec.audios = [], []
        for v in rec.videos:
            rec.video_audio.append(len(rec.audios) if has_audio(v) else None)
            if rec.video_audio[-1] is not None:
                rec.audios.append(v)

    def _render(self, prompt: Any, row: Row, rec: _Record) -> Any:
        cfg = self.cfg
        n_audio = 0 if rec.video_audio is not None else len(rec.audios)  # a video's audio has no placeholder
        if cfg.chat_template:
            return build_messages(prompt, system_prompt=cfg.system_prompt, num_images=len(rec.images),
                                  num_audios=n_audio, num_videos=len(rec.videos), origin=row.origin,
                                  key=cfg.prompt_key)
        mm = self.multimodal
        return raw_text(prompt, system_prompt=cfg.system_prompt, num_images=len(rec.images),
                        num_audios=n_audio, num_videos=len(rec.videos), origin=row.origin,
                        key=cfg.prompt_key, image_placeholder=mm.image_placeholder if mm else "",
                        audio_placeholder=mm.audio_placeholder if mm else "",
                        video_placeholder=mm.placeholders["video"] if mm else "")

    def _encode(self, rows: list[Row], texts: list[Any]) -> list[list[int]]:
        tok = self.tokenizer
        try:
            if self.cfg.chat_template:
                out = tok.apply_chat_template(texts, add_generation_prompt=True, tokenize=True, return_dict=False)
            else:
                out = tok(texts, add_special_tokens=True)["input_ids"]
            return [list(map(int, ids)) for ids in out]
        except Exception as exc:
            if len(rows) == 1:
                what = "apply the chat template to" if self.cfg.chat_template else "tokenize"
                raise UserError(f"{rows[0].origin}: cannot {what} the prompt: {type(exc).__name__}: {exc}") from None
            # find the row that fails, to name it
            return [ids for r, t in zip(rows, texts, strict=True) for ids in self._encode([r], [t])]
