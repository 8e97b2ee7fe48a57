"""Typed recipe schema: :class:`RecipeConfig`, assembled from one module per section (``config/model.py``,
``config/rollout.py``, ``config/trainer.py`` ...), whose classes are re-exported here. Imports no torch and no
trainer or rollout code (the CLI, the launcher and the monitor validate recipes without them). The names it holds
(algorithm, reward, environment, tool parser, Slurm parameters) are checked against their registries by
:mod:`relax_hpc.launch.checks`, what needs a trainer backend's knowledge (the megatron layout against the model) by
:mod:`relax_hpc.trainer.checks`: the entry points call both after the schema.

Precedence, stated once: ``--set`` overrides > recipe file > defaults. Every field has a docstring (shown by
``relax-hpc validate --explain`` and in docs/recipes.md). Sections with variants (``trainer`` by ``backend``,
``rollout`` by ``engine``, ``algorithm`` by ``name``) are discriminated unions: a key of a variant that is not
selected is an error.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from relax_hpc.config.algorithm import (
    ALGORITHM_VARIANTS,
    AlgorithmBase,
    AlgorithmConfig,
    DistillAlgorithmConfig,
    DistillConfig,
    GRPOConfig,
    OverlongConfig,
    SAPOConfig,
    algorithm_config,
)
from relax_hpc.config.base import INT_LIMIT, SEED_LIMIT, Section, Variants
from relax_hpc.config.data import MEDIA_OPTION_KEYS, DataConfig, MediaConfig, TaskConfig
from relax_hpc.config.env import EnvConfig, SandboxConfig
from relax_hpc.config.eval import EvalConfig
from relax_hpc.config.launch import LaunchConfig, RoleResources
from relax_hpc.config.model import LoraConfig, ModelConfig, TinyModelConfig
from relax_hpc.config.monitor import MonitorConfig
from relax_hpc.config.reward import RewardConfig
from relax_hpc.config.rollout import (
    ROLLOUT_VARIANTS,
    HFRolloutConfig,
    RolloutBase,
    RolloutConfig,
    SamplingConfig,
    ServerConfig,
    ServerRolloutBase,
    SGLangConfig,
    SGLangRolloutConfig,
    VLLMRolloutConfig,
)
from relax_hpc.config.store import StoreConfig
from relax_hpc.config.trainer import (
    TRAINER_VARIANTS,
    MegatronConfig,
    MegatronTrainerConfig,
    TorchTrainerConfig,
    TrainerBase,
    TrainerConfig,
)
from relax_hpc.config.warmup import SFTWarmupConfig
from relax_hpc.config.weights import (
    AutoTransport,
    DeltaConfig,
    FilesTransport,
    MemoryTransport,
    ProcessGroupTransport,
    ServerTransport,
    WeightSyncConfig,
    WeightTransport,
)

__all__ = [
    "ALGORITHM_VARIANTS",
    "INT_LIMIT",
    "MEDIA_OPTION_KEYS",
    "NAME_PATTERN",
    "ROLLOUT_VARIANTS",
    "SEED_LIMIT",
    "TRAINER_VARIANTS",
    "AlgorithmBase",
    "AlgorithmConfig",
    "AutoTransport",
    "DataConfig",
    "DeltaConfig",
    "DistillAlgorithmConfig",
    "DistillConfig",
    "EnvConfig",
    "EvalConfig",
    "FilesTransport",
    "GRPOConfig",
    "HFRolloutConfig",
    "LaunchConfig",
    "LoraConfig",
    "MediaConfig",
    "MegatronConfig",
    "MegatronTrainerConfig",
    "MemoryTransport",
    "ModelConfig",
    "MonitorConfig",
    "OverlongConfig",
    "ProcessGroupTransport",
    "RecipeConfig",
    "RewardConfig",
    "RoleResources",
    "RolloutBase",
    "RolloutConfig",
    "SAPOConfig",
    "SFTWarmupConfig",
    "SGLangConfig",
    "SGLangRolloutConfig",
    "SamplingConfig",
    "SandboxConfig",
    "Section",
    "ServerConfig",
    "ServerRolloutBase",
    "ServerTransport",
    "StoreConfig",
    "TaskConfig",
    "TinyModelConfig",
    "TorchTrainerConfig",
    "TrainerBase",
    "TrainerConfig",
    "VLLMRolloutConfig",
    "Variants",
    "WeightSyncConfig",
    "WeightTransport",
    "algorithm_config",
]

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
"""A run name: becomes a folder name under ``runs/`` and a Slurm job name."""


class RecipeConfig(Section):
    """A whole RL run."""

    name: str = "run"
    """Name of the run (run dirs and job names start with it): letters, digits, ``.``, ``_``, ``-``; no path
    separators; at most 100 characters."""
    seed: int = Field(0, ge=0, le=SEED_LIMIT)
    """Seed for data order, sampling and initialisation."""
    mode: Literal["colocate", "fully_async"] = "colocate"
    """``colocate``: one group generates then trains (strictly on-policy). ``fully_async``: rollout workers and the
    trainer overlap, linked by the sample store and weight snapshots."""
    num_steps: int = Field(100, ge=1)
    """Trainer steps (one optimizer update each)."""
    max_staleness: int = Field(1, ge=0)
    """fully_async: how many policy versions a sample may lag the trainer. 0 = on-policy by version. colocate with
    ``rollout.partial``: how many versions a carried token may lag when trained."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Policy model."""
    data: DataConfig
    """Prompts."""
    rollout: RolloutConfig = Field(default_factory=HFRolloutConfig)
    """Generation."""
    algorithm: AlgorithmConfig = Field(default_factory=GRPOConfig)
    """Objective."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward."""
    trainer: TrainerConfig = Field(default_factory=TorchTrainerConfig)
    """Learner."""
    warmup: SFTWarmupConfig = Field(default_factory=SFTWarmupConfig)
    """Optional supervised warm-up."""
    weights: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
    """Weight sync."""
    store: StoreConfig = Field(default_factory=StoreConfig)
    """Sample store."""
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    """Executor and Slurm resources."""
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """Metrics sinks and alerts."""
    eval: EvalConfig | None = None
    """Evaluation on a held-out set during training (None = none); see :mod:`relax_hpc.config.eval`."""

    @property
    def colocated(self) -> bool:
        """Generation and training take turns in one role (``colocate``), rather than overlapping in separate roles:
        the layers below the role table (relax_hpc/roles/spec.py, ``ModeSpec.overlapped``) ask this, not the name."""
        return self.mode == "colocate"

    @model_validator(mode="after")
    def _lora_backend(self) -> RecipeConfig:
        if self.model.lora is not None and self.trainer.backend != "torch":
            raise ValueError(f"model.lora: trainer.backend {self.trainer.backend} does not train LoRA adapters; use "
                             "trainer.backend: torch, or drop model.lora")
        lora, engine = self.model.lora, self.rollout.engine
        if lora is not None and engine in ("vllm", "sglang") and lora.modules_to_save:
            raise ValueError(f"model.lora.modules_to_save {lora.modules_to_save}: the {engine} engine serves "
                             "adapters only (no module trained fully); drop them or use rollout.engine: hf")
        if lora is not None and engine == "vllm" and lora.rank > 512:
            raise ValueError(f"model.lora.rank {lora.rank}: vLLM serves ranks up to 512")
        return self

    @model_validator(mode="after")
    def _partial_rollouts(self) -> RecipeConfig:
        partial = self.rollout.partial
        if partial is None:
            return self
        if not self.colocated:
            raise ValueError("rollout.partial: only mode colocate (fully_async workers already overlap steps); drop "
                             "rollout.partial")
        if self.rollout.env is not None:
            raise ValueError("rollout.partial: multi-turn episodes (rollout.env) are not carried between steps; drop "
                             "one of them")
        if partial.carry_over and self.max_staleness < 1:
            raise ValueError("rollout.partial.carry_over: a carried token is at least one version old when trained; "
                             "set max_staleness >= 1 or carry_over: false")
        return self

    @model_validator(mode="after")
    def _server_sleep(self) -> RecipeConfig:
        if not isinstance(self.rollout, ServerRolloutBase):
            return self
        level = self.rollout.server.sleep_level
        if not self.colocated and level:
            raise ValueError(f"rollout.server.sleep_level={level}: only colocate puts its servers to sleep (in "
                             "fully_async they generate while the trainer trains); drop it or use mode: colocate")
        if self.colocated and self.weights.publish_every != 1:
            raise ValueError(f"weights.publish_every={self.weights.publish_every}: in colocate a server engine loads "
                             "every version from its snapshot files; use 1")
        return self

    @model_validator(mode="after")
    def _env_warmup(self) -> RecipeConfig:
        if self.warmup.source == "env" and self.warmup.steps and self.rollout.env is None:
            raise ValueError("warmup.source: env needs rollout.env (an episode environment)")
        return self  # the environment's warm-up hook: relax_hpc.launch.checks

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        import re

        if not re.match(NAME_PATTERN, v):
            shown = v if len(v) <= 60 else f"{v[:60]}... ({len(v)} chars)"
            raise ValueError(f"{shown!r} is not a safe run name: use 1-100 letters, digits, '.', '_' or '-', "
                             "starting with a letter or digit (it becomes a folder under runs/)")
        return v
