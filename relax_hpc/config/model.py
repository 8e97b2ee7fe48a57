"""The ``model`` section: the policy model and its tokenizer (no torch here)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from relax_hpc.config.base import SEED_LIMIT, Section


class TinyModelConfig(Section):
    """Shape of a built-in tiny model made from config with random weights (no download)."""

    arch: Literal["qwen3", "qwen2_5_vl", "qwen3_vl", "qwen2_audio", "qwen2_5_omni", "qwen3_omni"] = "qwen3"
    """Architecture family of the tiny model (``qwen2_5_omni`` / ``qwen3_omni``: the thinker of Qwen2.5-Omni /
    Qwen3-Omni-MoE, taking text, images, audios and videos; ``qwen3_vl``: Qwen3-VL, images and videos with
    timestamps)."""
    hidden_size: int = Field(64, ge=8)
    """Hidden size."""
    num_layers: int = Field(2, ge=1)
    """Number of transformer layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = Field(128, ge=8)
    """MLP intermediate size."""
    max_position: int = Field(256, ge=16)
    """Maximum sequence length (positions)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output layer (as Qwen3 <= 4B do). ``False`` for the ``vllm`` engine on the
    CPU: vLLM's CPU backend does not refresh a tied output layer on an in-place weight reload, so the engine would
    restart its server on every update."""

    @model_validator(mode="after")
    def _heads(self) -> TinyModelConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}")
        return self


LORA_TARGETS_DEFAULT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a Qwen/Llama decoder layer: LoRA's default targets."""


class LoraConfig(Section):
    """Low-rank adapters (PEFT's LoRA) on the policy: only the adapters (and ``modules_to_save``) are trained; the
    base weights stay frozen. The torch trainer backend only."""

    rank: int = Field(16, gt=0)
    """Adapter rank ``r``."""
    alpha: float = Field(32.0, gt=0)
    """Scaling numerator: the adapter's update is scaled by ``alpha / rank``."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input (training only)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS_DEFAULT), min_length=1)
    """Names (last component) of the linear layers that get adapters; each must exist in the model (checked when the
    model is built)."""
    modules_to_save: list[str] = Field(default_factory=list)
    """Modules trained fully besides the adapters (e.g. ``lm_head``); saved with the adapter."""

    @field_validator("target_modules", "modules_to_save")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        for name in v:
            if not name or not all(part.isidentifier() or part.isdigit() for part in name.split(".")):
                raise ValueError(f"{name!r} is not a module name (dotted identifiers)")
        return v


class ModelConfig(Section):
    """The policy model and its tokenizer."""

    path: str = "tiny"
    """``tiny`` builds a small model from ``tiny`` with random weights and the built-in offline tokenizer; otherwise a
    local folder in HF format (config.json + safetensors + tokenizer), or a hub name where the machine can reach a
    hub."""
    tokenizer: str | None = None
    """Tokenizer folder or hub name; defaults to ``path``. ``builtin:digits`` is the offline demo tokenizer."""
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    """Shape of the tiny model (used when ``path`` is ``tiny``)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Training/generation dtype. ``auto``: float32 on CPU, bfloat16 on GPU."""
    trust_remote_code: bool = False
    """Passed to transformers when loading ``path``."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    attn_implementation: Literal["auto", "sdpa", "flex_attention", "flash_attention_2", "eager"] = "auto"
    """Attention kernel (``auto`` = ``sdpa``). Packed micro-batches are fastest with a kernel that skips the other
    sequences' blocks (``flex_attention``, compiled on first use; ``flash_attention_2`` where flash-attn is
    installed). See docs/benchmarks.md for measured figures."""
    init_seed: int = Field(0, ge=0, le=SEED_LIMIT)
    """Seed for the random weights of a tiny model."""
    lora: LoraConfig | None = None
    """Train low-rank adapters instead of the full model (None: full fine-tuning). Snapshots then hold only the
    adapter (docs/lora.md)."""
