"""The ``algorithm`` section: the RL objective; ``algorithm.name`` selects the options that exist.

``algorithm`` is a discriminated union on the family of ``algorithm.name``: :class:`SAPOConfig` (``sapo``: the gate
temperatures ``sapo_tau_*``), :class:`DistillAlgorithmConfig` (``distill``: the ``distill`` section) and
:class:`GRPOConfig` (``grpo``, ``gspo``, a user ``module:attr``: the shared options only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union

from pydantic import Field, field_validator

from relax_hpc.config.base import Section, Variants


class OverlongConfig(Section):
    """DAPO's soft overlong punishment."""

    enabled: bool = False
    """Penalise responses that approach ``max_new_tokens``."""
    buffer_tokens: int = Field(16, ge=1)
    """Length of the soft-penalty zone before the limit."""
    penalty: float = 1.0
    """Largest penalty (reached at the limit), subtracted from the reward."""


class DistillConfig(Section):
    """On-policy distillation: the teacher's log-probs shape the advantage (reverse KL)."""

    teacher: str | None = None
    """Teacher model path (HF format) or ``tiny`` with ``teacher_seed``."""
    coef: float = 1.0
    """Weight of the reverse-KL term in the per-token advantage."""
    reward_coef: float = 0.0
    """Weight of the task reward's group advantage added to it (0 = pure distillation)."""


class AlgorithmBase(Section):
    """The RL objective. ``name`` picks a module of the algorithm registry; the keys below are every algorithm's
    options, and ``sapo`` and ``distill`` have options of their own (an option of another algorithm is an error)."""

    name: str = "grpo"
    """Registered algorithm: ``grpo``, ``gspo``, ``sapo``, ``distill``, or ``module:attr`` of a user one."""
    clip_low: float = Field(0.2, ge=0.0)
    """PPO clip range below 1 (ratio >= 1 - clip_low)."""
    clip_high: float = Field(0.28, ge=0.0)
    """PPO clip range above 1 (clip-higher: ratio <= 1 + clip_high)."""
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = (
        "token_mean")
    """Loss aggregation: over all tokens of the batch, or per sequence then averaged (``_norm``: Dr.GRPO's constant
    normaliser = max_new_tokens)."""
    std_normalize: bool = True
    """Divide group advantages by the group's reward std (False = Dr.GRPO)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards have zero variance (they carry no signal)."""
    overlong: OverlongConfig = Field(default_factory=OverlongConfig)
    """DAPO's overlong penalty."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL penalty to the reference model (0 = no reference model is kept)."""
    kl_type: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator: k1 = -log r, k2 = (log r)^2 / 2, k3 = r - 1 - log r, with r = pi_ref / pi."""
    entropy_coef: float = 0.0
    """Entropy bonus weight (subtracted from the loss)."""
    tis_cap: float | None = Field(2.0, ge=1.0)
    """Truncated importance sampling against the rollout policy's log-probs: weight min(pi_old/pi_rollout, cap).
    ``None`` disables the correction."""
    proximal: bool = False
    """Decoupled PPO: clip against the trainer's own recomputed log-probs (the proximal policy) and correct the
    behaviour mismatch with the truncated IS weight."""


OWN_OPTIONS = ("sapo", "distill")
"""Algorithm names with options of their own (a variant each)."""


class GRPOConfig(AlgorithmBase):
    """``grpo``, ``gspo`` or a user algorithm (``module:attr``): the shared options only."""

    @field_validator("name")
    @classmethod
    def _not_a_variant(cls, v: str) -> str:
        if v in OWN_OPTIONS:
            raise ValueError(f"{v} has options of its own: build its variant ({ALGORITHM_VARIANTS.models[v].__name__})")
        return v


class SAPOConfig(AlgorithmBase):
    """``algorithm.name: sapo``: a soft, temperature-gated trust region instead of the clip."""

    name: Literal["sapo"] = "sapo"
    """Soft adaptive policy optimisation."""
    sapo_tau_pos: float = Field(1.0, gt=0.0)
    """SAPO gate temperature for positive advantages."""
    sapo_tau_neg: float = Field(1.05, gt=0.0)
    """SAPO gate temperature for negative advantages."""


class DistillAlgorithmConfig(AlgorithmBase):
    """``algorithm.name: distill``: on-policy distillation from a teacher."""

    name: Literal["distill"] = "distill"
    """On-policy distillation."""
    distill: DistillConfig = Field(default_factory=DistillConfig)
    """On-policy distillation settings."""


def algorithm_family(name: Any) -> str:
    """The variant tag of an algorithm name: ``sapo`` and ``distill`` their own, every other name ``grpo``."""
    return name if name in OWN_OPTIONS else "grpo"


ALGORITHM_VARIANTS = Variants("name", {"grpo": GRPOConfig, "sapo": SAPOConfig, "distill": DistillAlgorithmConfig},
                              default="grpo", family=algorithm_family)
"""``algorithm`` by the family of ``algorithm.name``."""

if TYPE_CHECKING:
    AlgorithmConfig = Union[GRPOConfig, SAPOConfig, DistillAlgorithmConfig]  # noqa: UP007
else:
    AlgorithmConfig = ALGORITHM_VARIANTS.annotation()
"""The ``algorithm`` section: one of its variants."""


V = TypeVar("V", bound=AlgorithmBase)


def own_options(cfg: AlgorithmBase, variant: type[V]) -> V:
    """``cfg`` as the variant whose options an algorithm reads (``SAPOConfig`` for ``sapo``); a
    :class:`~relax_hpc.errors.ConfigError` where the recipe selected another (a user algorithm reusing ``sapo``'s
    loss gets the shared options only)."""
    if not isinstance(cfg, variant):
        from relax_hpc.errors import ConfigError

        tag = next(t for t, m in ALGORITHM_VARIANTS.models.items() if m is variant)
        raise ConfigError(f"algorithm {cfg.name!r} reads the options of algorithm.name: {tag}, which this recipe "
                          f"does not select")
    return cfg


def algorithm_config(**fields: Any) -> AlgorithmConfig:
    """An ``algorithm`` section from keyword fields, its variant chosen by ``name`` as in a recipe."""
    from pydantic import TypeAdapter

    return TypeAdapter(AlgorithmConfig).validate_python(fields)
