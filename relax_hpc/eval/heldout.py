"""The held-out prompts of a recipe's ``eval`` section, checked against the training prompts.

The held-out set is ``data`` with ``eval.data``'s fields in place of its own (see :mod:`relax_hpc.config.eval`).
The check compares prompts as the data holds them (the prompt field's text, or its chat messages as JSON):

* training data from files: every training row's prompt is read; a held-out prompt among them is an error naming
  how many and the first (a held-out set must be held out);
* a built-in training task: its prompts depend on the sampling seed of each rollout worker, so the check is against
  every prompt the task can produce (its letter and a digit string of ``min_len..max_len`` digits); held-out rows of
  that form are left out and counted (``eval/heldout_overlap_dropped``), an error if none remain.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax_hpc.config.schema import DataConfig, RecipeConfig
from relax_hpc.errors import ConfigError


@dataclass
class HeldOut:
    prompts: list[Any]
    """The held-out :class:`~relax_hpc.data.dataset.Prompt` s, in file order."""
    overlap_dropped: int = 0
    """Rows left out because the training task can produce them."""


def heldout_data(cfg: RecipeConfig) -> DataConfig:
    """The :class:`DataConfig` of the held-out set."""
    assert cfg.eval is not None
    base = cfg.data.model_dump()
    given = dict(cfg.eval.data)
    if "path" in given or "task" in given:
        base["path"], base["task"] = None, None
    base.update(given)
    return DataConfig.model_validate(base)


def prompt_key_of(raw: Any) -> str:
    """A prompt as comparable text: the string itself, chat messages as sorted JSON."""
    return raw if isinstance(raw, str) else json.dumps(raw, sort_keys=True, default=str)


def training_membership(cfg: RecipeConfig) -> Callable[[str], bool]:
    """Whether a prompt (as :func:`prompt_key_of` gives it) is, or can be, a training prompt."""
    data = cfg.data
    if data.task is not None:
        from relax_hpc.data.tasks import LETTERS

        letter, lo, hi = LETTERS[data.task.name], data.task.min_len, data.task.max_len
        return lambda p: p[:1] == letter and p[1:].isdigit() and lo <= len(p) - 1 <= hi
    from relax_hpc.data.dataset import row_field
    from relax_hpc.data.sources import read_rows

    assert data.path is not None
    seen = {prompt_key_of(row_field(r, data.prompt_key, "data.prompt_key")) for r in read_rows(data.path)}
    return seen.__contains__


def load_heldout(cfg: RecipeConfig, tokenizer: Any) -> HeldOut:
    """The held-out prompts (tokenized as the training prompts are), checked as the module docstring says."""
    from relax_hpc.data import PromptDataset

    assert cfg.eval is not None
    dcfg = heldout_data(cfg)
    ds = PromptDataset(dcfg, tokenizer, seed=cfg.seed + 1)  # text only: media prompts are not evaluated
    prompts = [ds.prompt(i, tensors=False) for i in range(len(ds))]
    in_training = training_membership(cfg)
    kept = [p for p in prompts if not in_training(prompt_key_of(p.raw))]
    shared = len(prompts) - len(kept)
    where = dcfg.path or f"task {dcfg.task.name if dcfg.task else '?'}"
    if shared and dcfg.task is None:
        first = next(p for p in prompts if in_training(prompt_key_of(p.raw)))
        raise ConfigError(f"eval.data: {shared} of the {len(prompts)} held-out prompts of {where} are training "
                          f"prompts too (first: {prompt_key_of(first.raw)[:80]!r}); a held-out set must not share "
                          "prompts with data")
    if not kept:
        raise ConfigError(f"eval.data: every prompt of {where} can be a training prompt (the training task makes "
                          "them); hold out other lengths or another task")
    if cfg.eval.max_prompts is not None:
        kept = kept[:cfg.eval.max_prompts]
    return HeldOut(kept, shared)
