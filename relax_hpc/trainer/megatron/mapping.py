"""HF <-> megatron-core weights: names and layouts, one table per architecture, with tensor/pipeline sharding.

Pure torch (no megatron import; torch itself is imported on first use, so validating a recipe needs none), tested
on the CPU. The megatron names are those of megatron-core's ``GPTModel`` built from
``get_gpt_layer_local_spec(qk_layernorm=..., normalization="RMSNorm")`` (norms as their own modules:
``input_layernorm``, ``pre_mlp_layernorm``); with ``fused_norms=True`` they are the TransformerEngine spec's, where
each norm is part of the following linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).

Layouts:

- ``linear_qkv`` (column-parallel) fuses q, k and v per query group: for each of the ``num_query_groups`` KV heads,
  the rows of that group's ``heads / groups`` query heads, then its key head, then its value head. Tensor-parallel
  rank ``r`` holds a contiguous block of whole groups, so the split is a plain chunk along rows.
- ``linear_fc1`` (column-parallel, gated) holds, on each rank, that rank's slice of ``gate_proj`` followed by its slice
  of ``up_proj`` (megatron chunks the local output in two).
- ``linear_proj`` and ``linear_fc2`` are row-parallel (split along the input dimension); norms are replicated.
- ``embedding.word_embeddings`` and ``output_layer`` are vocabulary-parallel: the vocabulary is padded with zero rows
  to a multiple of ``vocab_multiple * tp`` and split along rows; the inverse drops the padding.
- Pipeline stage ``s`` of ``pp`` holds layers ``[s*L/pp, (s+1)*L/pp)`` under local indices, the embedding on the first
  stage, the final norm and the output layer on the last. With tied embeddings, a last stage that is not also the
  first holds a copy of the embedding as ``output_layer.weight``; a tied model's HF weights carry no ``lm_head``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from relax_hpc.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

Kind = Literal["replicated", "row", "qkv", "gate_up"]


@dataclass(frozen=True)
class Rule:
    """One megatron tensor of a layer and the HF tensor(s) it is made from (``{i}``: the layer index)."""

    mcore: str
    hf: tuple[str, ...]
    kind: Kind


@dataclass(frozen=True)
class ArchTable:
    """The mapping of one HF ``model_type``: per-layer rules and the architecture's switches."""

    qkv_bias: bool
    qk_norm: bool
    layer_rules: tuple[Rule, ...]


def _layer_rules(*, qkv_bias: bool, qk_norm: bool) -> tuple[Rule, ...]:
    """The dense Qwen-family decoder layer (Qwen2/2.5 have q/k/v biases, Qwen3 has q/k RMSNorms)."""
    a, m = "model.layers.{i}.self_attn.", "model.layers.{i}.mlp."
    rules = [
        Rule("input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",), "replicated"),
        Rule("self_attention.linear_qkv.weight", (a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
             "qkv"),
    ]
    if qkv_bias:
        rules.append(Rule("self_attention.linear_qkv.bias", (a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                          "qkv"))
    if qk_norm:
        rules += [Rule("self_attention.q_layernorm.weight", (a + "q_norm.weight",), "replicated"),
                  Rule("self_attention.k_layernorm.weight", (a + "k_norm.weight",), "replicated")]
    rules += [
        Rule("self_attention.linear_proj.weight", (a + "o_proj.weight",), "row"),
        Rule("pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",), "replicated"),
        Rule("mlp.linear_fc1.weight", (m + "gate_proj.weight", m + "up_proj.weight"), "gate_up"),
        Rule("mlp.linear_fc2.weight", (m + "down_proj.weight",), "row"),
    ]
    return tuple(rules)


ARCHS: dict[str, ArchTable] = {
    "qwen3": ArchTable(qkv_bias=False, qk_norm=True, layer_rules=_layer_rules(qkv_bias=False, qk_norm=True)),
    "qwen2": ArchTable(qkv_bias=True, qk_norm=False, layer_rules=_layer_rules(qkv_bias=True, qk_norm=False)),
}
"""HF ``model_type`` -> its mapping (``qwen2`` is also Qwen2.5's model type)."""

FUSED_NORM_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}
"""Local-spec norm name -> the TransformerEngine spec's name (norm fused into the next linear)."""

EMBED, FINAL_NORM, OUTPUT = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"
HF_EMBED, HF_NORM, HF_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


@dataclass(frozen=True)
class ModelShape:
    """What the mapping needs of an HF ``config.json``."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied: bool

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelShape:
        """The shape of an HF config (a ``config.json`` mapping)."""
        heads = int(hf["num_attention_heads"])
        return cls(model_type=str(hf.get("model_type")), hidden_size=int(hf["hidden_size"]),
                   num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
                   num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                   head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
                   intermediate_size=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
                   tied=bool(hf.get("tie_word_embeddings", False)))

    @property
    def table(self) -> ArchTable:
        """This architecture's mapping (a :class:`UserError` naming the mapped ones if there is none)."""
        if self.model_type not in ARCHS:
            raise UserError(f"model_type {self.model_type!r} has no megatron weight mapping (mapped: "
                            f"{', '.join(sorted(ARCHS))}); use trainer.backend: torch")
        return ARCHS[self.model_type]


def padded_vocab_size(vocab_size: int, tp: int, vocab_multiple: int = 128) -> int:
    """The vocabulary rounded up to a multiple of ``vocab_multiple * tp`` (each TP rank an equal share)."""
    step = vocab_multiple * tp
    return -(-vocab_size // step) * step


def stage_layers(shape: ModelShape, pp: int, pp_rank: int) -> range:
    """The global indices of the layers pipeline stage ``pp_rank`` holds."""
    assert shape.num_layers % pp == 0 and 0 <= pp_rank < pp, (shape.num_layers, pp, pp_rank)
    per = shape.num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def layer_stage(shape: ModelShape, pp: int, layer: int) -> int:
    """The pipeline stage of ``pp`` that holds global layer ``layer`` (the inverse of :func:`stage_layers`)."""
    assert shape.num_layers % pp == 0 and 0 <= layer < shape.num_layers, (shape.num_layers, pp, layer)
    return layer // (shape.num_layers // pp)


def _mcore_name(rule: Rule, local: int, fused_norms: bool) -> str:
    name = FUSED_NORM_NAMES.get(rule.mcore, rule.mcore) if fused_norms else rule.mcore
    return f"decoder.layers.{local}.{name}"


# ---------------------------------------------------------------------------------------------------- HF -> megatron
def _cat(tensors: list[Tensor], dim: int) -> Tensor:
    import torch

    return torch.cat(tensors, dim=dim)


def _own(t: Tensor) -> Tensor:
    """``t`` as a contiguous tensor of its own (no view into a bigger one)."""
    return t.clone() if t.is_contiguous() else t.contiguous()


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: ModelShape) -> Tensor:
    """q, k, v (weights ``[out, hidden]`` or biases ``[out]``) -> megatron's per-group ``[q..., k, v]`` rows."""
    g, d = shape.num_kv_heads, shape.head_dim
    rest = q.shape[1:]
    parts = [q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
    return _cat(parts, dim=1).reshape(-1, *rest)


def _shard(kind: Kind, tensors: list[Tensor], shape: ModelShape, tp: int, r: int) -> Tensor:
    if kind == "replicated":
        out = tensors[0]
    elif kind == "row":
        out = tensors[0].chunk(tp, dim=1)[r]
    elif kind == "qkv":
        out = fuse_qkv(*tensors, shape).chunk(tp, dim=0)[r]
    else:  # gate_up
        out = _cat([tensors[0].chunk(tp, dim=0)[r], tensors[1].chunk(tp, dim=0)[r]], dim=0)
    return _own(out)


def _vocab_shard(t: Tensor, shape: ModelShape, tp: int, r: int, vocab_multiple: int) -> Tensor:
    padded = padded_vocab_size(shape.vocab_size, tp, vocab_multiple)
    full = _cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])], dim=0) if padded > t.shape[0] else t
    return _own(full.chunk(tp, dim=0)[r])


def hf_to_megatron(hf_sd: Mapping[str, Tensor], shape: ModelShape, *, tp: int = 1, tp_rank: int = 0, pp: int = 1,
                   pp_rank: int = 0, vocab_multiple: int = 128, fused_norms: bool = False) -> dict[str, Tensor]:
    """The megatron state dict of one (TP rank, PP stage) made from a whole HF state dict."""
    table = shape.table
    out: dict[str, Tensor] = {}
    layers = stage_layers(shape, pp, pp_rank)
    for local, i in enumerate(layers):
        for rule in table.layer_rules:
            srcs = [hf_sd[n.format(i=i)] for n in rule.hf]
            out[_mcore_name(rule, local, fused_norms)] = _shard(rule.kind, srcs, shape, tp, tp_rank)
    first, last = pp_rank == 0, pp_rank == pp - 1
    if first:
        out[EMBED] = _vocab_shard(hf_sd[HF_EMBED], shape, tp, tp_rank, vocab_multiple)
    if last:
        out[FINAL_NORM] = hf_sd[HF_NORM].clone()
        if not shape.tied:
            out[OUTPUT] = _vocab_shard(hf_sd[HF_HEAD], shape, tp, tp_rank, vocab_multiple)
        elif not first:
            out[OUTPUT] = _vocab_shard(hf_sd[HF_EMBED], shape, tp, tp_rank, vocab_multiple)
    return out


# ---------------------------------------------------------------------------------------------------- megatron -> HF
def unfuse_qkv(qkv: Tensor, shape: ModelShape) -> tuple[Tensor, Tensor, Tensor]:
    """The inverse of :func:`fuse_qkv` on the whole (TP-gathered) tensor."""
    g, d = shape.num_kv_heads, shape.head_dim
    per_group = shape.num_heads // g * d
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, per_group + 2 * d, *rest).split([per_group, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _gather(kind: Kind, shards: list[Tensor], shape: ModelShape) -> list[Tensor]:
    if kind == "replicated":
        return [shards[0].clone()]
    if kind == "row":
        return [_cat(shards, dim=1)]
    if kind == "qkv":
        return [_own(t) for t in unfuse_qkv(_cat(shards, dim=0), shape)]
    halves = [s.chunk(2, dim=0) for s in shards]  # gate_up
    return [_cat([h[0] for h in halves], dim=0), _cat([h[1] for h in halves], dim=0)]


def megatron_stage_to_hf(tp_shards: list[Mapping[str, Tensor]], shape: ModelShape, *, pp: int = 1,
                         pp_rank: int = 0, fused_norms: bool = False) -> dict[str, Tensor]:
    """The HF tensors pipeline stage ``pp_rank`` holds, from the state dicts of its TP ranks (in rank order)."""
    table = shape.table
    out: dict[str, Tensor] = {}
    for local, i in enumerate(stage_layers(shape, pp, pp_rank)):
        for rule in table.layer_rules:
            name = _mcore_name(rule, local, fused_norms)
            for hf_name, t in zip(rule.hf, _gather(rule.kind, [sd[name] for sd in tp_shards], shape), strict=True):
                out[hf_name.format(i=i)] = t
    if pp_rank == 0:
        out[HF_EMBED] = _cat([sd[EMBED] for sd in tp_shards], dim=0)[: shape.vocab_size].clone()
    if pp_rank == pp - 1:
        out[HF_NORM] = tp_shards[0][FINAL_NORM].clone()
        if not shape.tied:
            out[HF_HEAD] = _cat([sd[OUTPUT] for sd in tp_shards], dim=0)[: shape.vocab_size].clone()
    return out


def megatron_to_hf(shards: list[list[Mapping[str, Tensor]]], shape: ModelShape, *,
                   fused_norms: bool = False) -> dict[str, Tensor]:
    """The whole HF state dict from ``shards[pp_rank][tp_rank]`` (every stage's TP state dicts)."""
    out: dict[str, Tensor] = {}
    for s, tp_shards in enumerate(shards):
        out.update(megatron_stage_to_hf(tp_shards, shape, pp=len(shards), pp_rank=s, fused_norms=fused_norms))
    return out
