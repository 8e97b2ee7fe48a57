"""HF config -> megatron-core model arguments (pure data), and the checks of a megatron recipe.

:func:`model_args` gives the keyword arguments of megatron-core's ``TransformerConfig`` and ``GPTModel`` for an HF
``config.json``; the backend adds what is not data (the activation callable, the layer spec, dtypes).
:func:`check_recipe`
is what ``relax-hpc validate`` runs for ``trainer.backend: megatron``: the parallel layout against the model's shape,
the architecture's weight mapping, then megatron-core itself (found, not imported) — each problem one :class:`UserError`
naming the fix. Imports neither torch nor megatron.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_hpc.config.trainer import MegatronTrainerConfig
from relax_hpc.errors import UserError
from relax_hpc.trainer.megatron.mapping import ModelShape, padded_vocab_size

if TYPE_CHECKING:
    from relax_hpc.config.schema import ModelConfig, RecipeConfig

ACTIVATIONS = {"silu": "silu"}
"""HF ``hidden_act`` -> the activation the backend passes as ``activation_func`` (with ``gated_linear_unit``)."""


@dataclass(frozen=True)
class ModelArgs:
    """megatron-core's model arguments for one HF model and parallel layout (all plain data)."""

    transformer: dict[str, Any] = field(default_factory=dict)
    """``TransformerConfig(**transformer)``, less ``activation_func`` (see :attr:`activation`)."""
    gpt: dict[str, Any] = field(default_factory=dict)
    """``GPTModel(config, spec, **gpt)``."""
    activation: str = "silu"
    """The gated MLP's activation (``torch.nn.functional.silu`` for ``silu``)."""


def _rope_theta(hf: Mapping[str, Any]) -> float:
    """The RoPE base; a scaled RoPE (yarn, linear, ...) has no megatron mapping here yet."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in (None, "default"):
        raise UserError(f"rope type {kind!r} has no megatron mapping (only unscaled RoPE); use trainer.backend: torch")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def model_args(hf: Mapping[str, Any], *, tp: int = 1, pp: int = 1, pp_rank: int = 0, vocab_multiple: int = 128,
               recompute: bool = False) -> ModelArgs:
    """The ``TransformerConfig`` and ``GPTModel`` keyword arguments of HF config ``hf`` (checked first) for pipeline
    stage ``pp_rank`` of ``pp`` (the embedding on the first, the final norm and output layer on the last).
    ``recompute``: every layer's activations recomputed in the backward pass (full, uniform, one layer each)."""
    shape = ModelShape.from_hf(hf)
    check_layout(shape, tp=tp, pp=pp)
    table = shape.table
    act = str(hf.get("hidden_act", "silu"))
    if act not in ACTIVATIONS:
        raise UserError(f"hidden_act {act!r} has no megatron mapping (mapped: {', '.join(ACTIVATIONS)})")
    theta = _rope_theta(hf)
    transformer = {
        "num_layers": shape.num_layers, "hidden_size": shape.hidden_size, "num_attention_heads": shape.num_heads,
        "num_query_groups": shape.num_kv_heads, "kv_channels": shape.head_dim,
        "ffn_hidden_size": shape.intermediate_size, "normalization": "RMSNorm",
        "layernorm_epsilon": float(hf.get("rms_norm_eps", 1e-6)), "gated_linear_unit": True,
        "add_bias_linear": False, "add_qkv_bias": table.qkv_bias, "qk_layernorm": table.qk_norm,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "init_method_std": float(hf.get("initializer_range", 0.02)),
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "calculate_per_token_loss": True,
        "bias_activation_fusion": False, "masked_softmax_fusion": False, "apply_rope_fusion": False,
    }
    if recompute:
        transformer.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    gpt = {
        "vocab_size": padded_vocab_size(shape.vocab_size, tp, vocab_multiple),
        "max_sequence_length": int(hf.get("max_position_embeddings", 4096)),
        "position_embedding_type": "rope", "rotary_base": int(theta) if theta.is_integer() else theta,
        "share_embeddings_and_output_weights": shape.tied, "pre_process": pp_rank == 0,
        "post_process": pp_rank == pp - 1,
    }
    return ModelArgs(transformer=transformer, gpt=gpt, activation=ACTIVATIONS[act])


def optimizer_args(trainer: MegatronTrainerConfig) -> dict[str, Any]:
    """megatron-core's ``OptimizerConfig`` kwargs for ``trainer`` (AdamW: megatron's ``adam`` decouples weight decay),
    less the dtypes (``bf16``/``params_dtype``), which the backend sets from the model dtype."""
    mc = trainer.megatron
    return {"optimizer": "adam", "lr": trainer.lr, "weight_decay": trainer.weight_decay,
            "adam_beta1": trainer.betas[0], "adam_beta2": trainer.betas[1], "clip_grad": trainer.grad_clip,
            "use_distributed_optimizer": mc.distributed_optimizer}


def ddp_args(trainer: MegatronTrainerConfig, *, dist_opt: bool | None = None) -> dict[str, Any]:
    """megatron-core's ``DistributedDataParallelConfig`` kwargs (gradients reduced in float32, after the last
    micro-batch: the step's gradient is summed over micro-batches first). ``dist_opt``: whether the distributed
    optimizer is used (default: ``trainer.megatron.distributed_optimizer``; the backend turns it off on gloo with
    CUDA tensors)."""
    use = trainer.megatron.distributed_optimizer if dist_opt is None else dist_opt
    return {"use_distributed_optimizer": use, "grad_reduce_in_fp32": True, "overlap_grad_reduce": False,
            "check_for_nan_in_grad": True}


def check_ranks(num_ranks: int, *, tp: int, pp: int) -> None:
    """The trainer's processes are whole model replicas of ``tp * pp`` processes each."""
    if num_ranks % (tp * pp):
        raise UserError(f"trainer.num_ranks={num_ranks} is not a multiple of tp*pp={tp * pp}; "
                        f"use num_ranks = data-parallel size x {tp * pp}")


def check_layout(shape: ModelShape, *, tp: int, pp: int) -> None:
    """The parallel layout fits the model (TP divides heads, KV heads and the MLP; PP divides the layers) and the
    architecture has a weight mapping. The vocabulary is padded, never an error."""
    shape.table  # noqa: B018 (raises for an architecture without a mapping)
    for what, n in (("attention heads", shape.num_heads), ("key/value heads", shape.num_kv_heads),
                    ("MLP intermediate size", shape.intermediate_size)):
        if n % tp:
            raise UserError(f"trainer.megatron.tp={tp} does not divide the model's {n} {what}; "
                            f"use a tp that divides {n}")
    if shape.num_layers % pp:
        raise UserError(f"trainer.megatron.pp={pp} does not divide the model's {shape.num_layers} layers; "
                        f"use a pp that divides {shape.num_layers}")


def hf_config_of(model: ModelConfig) -> dict[str, Any] | None:
    """The HF config of the recipe's model when it is known without loading anything (a tiny model from config, a
    local folder with ``config.json``); None for a hub name (its shape is checked when the backend builds it)."""
    if model.path == "tiny":
        t = model.tiny
        model_type = "qwen3" if t.arch == "qwen3" else t.arch
        return {"model_type": model_type, "hidden_size": t.hidden_size, "num_hidden_layers": t.num_layers,
                "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
                "head_dim": t.hidden_size // t.num_heads, "intermediate_size": t.intermediate_size,
                "vocab_size": 0, "tie_word_embeddings": True, "max_position_embeddings": t.max_position}
    path = Path(model.path).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"model.path: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"model.path: {path} is not a JSON mapping")
    return data


def require_megatron_core() -> None:
    """megatron-core is installed (found, not imported: validation stays light), or one error naming the fix."""
    import importlib.util

    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):  # no ``megatron`` package, or a module without a spec
        found = False
    if not found:
        raise UserError("trainer.backend: megatron needs megatron-core, which is not installed: "
                        "pip install megatron-core (on the GPU nodes), or use trainer.backend: torch")


def check_recipe(cfg: RecipeConfig) -> None:
    """Everything a ``trainer.backend: megatron`` recipe can be checked for before launch (see module docstring)."""
    if not isinstance(cfg.trainer, MegatronTrainerConfig):
        raise UserError(f"trainer.backend is {cfg.trainer.backend}: no megatron layout to check")
    mc = cfg.trainer.megatron
    hf = hf_config_of(cfg.model)
    if hf is not None:
        try:
            shape = ModelShape.from_hf(hf)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"model.path: config.json lacks what the megatron mapping needs ({exc})") from None
        check_layout(shape, tp=mc.tp, pp=mc.pp)
        _rope_theta(hf)
    check_ranks(cfg.trainer.num_ranks, tp=mc.tp, pp=mc.pp)
    require_megatron_core()
