"""The ``eval`` recipe section: evaluation on a held-out set during training and after it.

The held-out set is the recipe's ``data`` with the fields of ``eval.data`` replacing its own (``path`` or ``task``
replaces the source; the prompt key, system prompt and chat template carry over unless given). Its prompts are
checked against the training prompts when the evaluator starts: a held-out file sharing prompts with the training
data is an error; a built-in task's prompts that the training prompts include are left out (counted), so the
held-out set never holds a training prompt.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    """As the recipe's sections: unknown keys are errors, no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)


class EvalSamplingConfig(_Section):
    """Sampling of the evaluation (greedy by default)."""

    temperature: float = Field(0.0, ge=0.0)
    """0 = greedy."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Most tokens per response (None = ``rollout.sampling.max_new_tokens``)."""
    stop: list[str] | None = None
    """Stop strings (None = ``rollout.sampling.stop``). Sampled evaluations (``temperature > 0``) draw from the
    engine's own seeded generator, like the rollouts (a request with a seed of its own would be batched alone)."""


class EvalConfig(_Section):
    """Evaluation on a held-out set: every ``every`` steps, before training and at the end."""

    data: dict[str, Any]
    """Fields of ``data`` for the held-out set, e.g. ``{path: heldout.jsonl}`` or ``{task: {name: reverse_digits,
    num_prompts: 100}}``; the other fields of ``data`` carry over."""
    every: int = Field(0, ge=0)
    """Evaluate every this many trainer steps (weight versions); 0 = only before training and at the end."""
    at_start: bool = True
    """Evaluate the initial weights (version 0) too: the curve's first point."""
    at_end: bool = True
    """Evaluate the final weights."""
    end_timeout_s: float = Field(1800.0, gt=0, allow_inf_nan=False)
    """fully_async: how long the launcher (local, or the Slurm job's script) waits for the evaluating worker's final
    evaluation once the trainer has finished, beyond the workers' usual grace, before it stops the worker."""
    max_prompts: int | None = Field(None, ge=1)
    """Use only the first this many held-out prompts (None = all)."""
    n_samples: int = Field(1, ge=1)
    """Samples per prompt."""
    pass_k: list[int] = Field(default_factory=lambda: [1])
    """The ``k`` of each ``eval/pass@k`` (unbiased estimator over ``n_samples``; each ``k <= n_samples``)."""
    threshold: float = 1.0
    """A sample counts as correct when its reward is at least this (``eval/accuracy_thresholded`` and pass@k)."""
    batch_prompts: int = Field(64, ge=1)
    """Prompts in flight at once."""
    source_key: str = Field("data_source", min_length=1)
    """Field of a row naming its data source: metrics are also given per source where rows have it."""
    sampling: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)
    """Sampling settings of the evaluation."""
    worker: int = Field(0, ge=0)
    """fully_async: the rollout worker (index) that evaluates each snapshot between its batches."""

    @field_validator("data")
    @classmethod
    def _data_fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        from relax_hpc.config.data import DataConfig

        if "path" not in v and "task" not in v:
            raise ValueError("eval.data needs `path` (a held-out JSONL/Parquet file) or `task` (a built-in task)")
        DataConfig.model_validate(v)  # the fields it gives must be valid data fields
        return v

    @model_validator(mode="after")
    def _pass_k(self) -> EvalConfig:
        bad = [k for k in self.pass_k if k < 1 or k > self.n_samples]
        if bad:
            raise ValueError(f"eval.pass_k {bad}: each k must be between 1 and eval.n_samples={self.n_samples}")
        return self

    def due(self, version: int, last: int | None, *, final: bool) -> bool:
        """Whether weights ``version`` are to be evaluated, the last evaluated version being ``last``."""
        if last is not None and version <= last:
            return False
        if version == 0:
            return self.at_start
        if final and self.at_end:
            return True
        if not self.every:
            return False
        return last is None or version // self.every > last // self.every  # crossed a multiple (versions may skip)
