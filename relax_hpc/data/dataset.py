"""Prompts, tokenized once: a built-in task or files (JSONL/Parquet/a folder), filtered by length, never truncated.

Each row's ``prompt_key`` (a string or chat messages) becomes token ids: through the tokenizer's chat template with
a generation prompt (``chat_template: true``; ``system_prompt`` first), or as raw text. A row may name ``images``
and/or ``audios`` (see :mod:`relax_hpc.data.messages` for the placeholders); their placeholder tokens are expanded
to the model's count at load time, so lengths are exact, and their tensors are made when a prompt is taken.
Prompts longer than ``max_prompt_tokens`` are skipped and counted (one warning). ``meta`` holds the row's other
fields plus ``index`` (position in the dataset) and ``source`` (``file:line`` or ``task``). ``prompt_key`` and
``answer_key`` may be dotted paths into nested fields (``reward_model.ground_truth``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_hpc.config.schema import DataConfig
from relax_hpc.data.media import MediaRef, resolve_ref
from relax_hpc.data.messages import build_messages, raw_text
from relax_hpc.data.sources import Row, read_rows
from relax_hpc.data.tasks import generate_task
from relax_hpc.errors import ConfigError, UserError

log = logging.getLogger(__name__)

MEDIA_KEYS = {"image": "images", "audio": "audios"}
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
    """Named model inputs of the prompt's images/audios (``pixel_values``, ``image_grid_thw``, ``input_features``,
    ``feature_attention_mask``), or None for a text prompt."""


@dataclass
class _Record:
    ids: list[int]
    answer: Any
    meta: dict[str, Any]
    images: list[MediaRef]
    audios: list[MediaRef]
    counts: tuple[list[int], list[int]] = ([], [])
    """Placeholder tokens per image and per audio."""


def _field(row: Row, key: str, setting: str) -> Any:
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
        if not self._records:
            raise UserError(f"data: all {self.num_rows} prompts of {where} are longer than "
                            f"data.max_prompt_tokens={cfg.max_prompt_tokens}")

    # ------------------------------------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: int) -> Prompt:
        """Prompt ``i`` (its media tensors are made now)."""
        rec = self._records[i]
        mm = None
        if rec.images or rec.audios:
            mm = self.multimodal.tensors(rec.images, rec.audios)
            counts = self.multimodal.token_counts(mm)
            assert counts == rec.counts, f"media token counts of {rec.meta['source']}: {counts} != {rec.counts}"
        return Prompt(list(rec.ids), rec.answer, dict(rec.meta), mm)

    def stats(self) -> dict[str, int]:
        """``data/rows``, ``data/prompts`` and ``data/too_long`` (skipped) counts."""
        return {"data/rows": self.num_rows, "data/prompts": len(self), "data/too_long": self.num_too_long}

    # ------------------------------------------------------------------------------------------------ building
    def _counts(self, refs: list[MediaRef], kind: str) -> list[int]:
        fn = self.multimodal.image_tokens if kind == "image" else self.multimodal.audio_tokens
        return [fn(r) for r in refs]

    def _media(self, row: Row, kind: str) -> list[MediaRef]:
        refs = row.fields.get(MEDIA_KEYS[kind])
        if refs is None:
            return []
        if not isinstance(refs, list):
            refs = [refs]
        if refs and self.multimodal is None:
            raise UserError(f"{row.origin}: the row has {MEDIA_KEYS[kind]} but the model is text-only "
                            "(use a Qwen2.5-VL / Qwen2-Audio model)")
        assert row.base_dir is not None
        return [resolve_ref(r, row.base_dir, row.origin, kind) for r in refs]

    def _tokenize(self, rows: list[Row]) -> list[_Record]:
        cfg = self.cfg
        recs = []
        prompts = []
        for row in rows:
            prompts.append(_field(row, cfg.prompt_key, "data.prompt_key"))
            answer = _field(row, cfg.answer_key, "data.answer_key")
            skip = {cfg.prompt_key, cfg.answer_key, *MEDIA_KEYS.values()}
            meta = {k: v for k, v in row.fields.items() if k not in skip}
            meta["source"] = row.origin
            recs.append(_Record([], answer, meta, self._media(row, "image"), self._media(row, "audio")))
        texts = [self._render(p, row, rec) for p, row, rec in zip(prompts, rows, recs, strict=True)]
        for row, rec, ids in zip(rows, recs, self._encode(rows, texts), strict=True):
            if rec.images or rec.audios:
                rec.counts = (self._counts(rec.images, "image"), self._counts(rec.audios, "audio"))
                ids = self.multimodal.expand(ids, *rec.counts, row.origin)
            rec.ids = ids
        return recs

    def _render(self, prompt: Any, row: Row, rec: _Record) -> Any:
        cfg = self.cfg
        if cfg.chat_template:
            return build_messages(prompt, system_prompt=cfg.system_prompt, num_images=len(rec.images),
                                  num_audios=len(rec.audios), origin=row.origin, key=cfg.prompt_key)
        mm = self.multimodal
        return raw_text(prompt, system_prompt=cfg.system_prompt, num_images=len(rec.images),
                        num_audios=len(rec.audios), origin=row.origin, key=cfg.prompt_key,
                        image_placeholder=mm.image_placeholder if mm else "",
                        audio_placeholder=mm.audio_placeholder if mm else "")

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
