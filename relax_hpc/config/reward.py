"""The ``reward`` section: how responses are scored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from relax_hpc.config.base import Section


class RewardConfig(Section):
    """How responses are scored."""

    name: str = "exact_match"
    """Built-in reward (``exact_match``, ``math``, ``format``, ``digits_positional``, ``multiple_choice``,
    ``boxed_answer``) or ``module:function`` /
    ``path/to/file.py:function`` of a user function. Checked when the config is validated."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments given to the reward function."""
    on_error: Literal["zero", "drop"] = "zero"
    """A reward that raises or returns NaN: count it, then score 0 (``zero``) or drop the whole group (``drop``)."""
    timeout_s: float = Field(60.0, gt=0)
    """Per-batch timeout of an async reward function."""
