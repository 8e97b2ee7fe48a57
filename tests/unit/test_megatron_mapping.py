"""The HF <-> megatron-core weight mapping and the megatron recipe checks (CPU, no megatron-core needed).

Tiny Qwen3 / Qwen2.5 models are made from config with random weights; their state dicts go through the mapping at
TP 1/2 and PP 1/2 and must come back bitwise; the fused QKV of a TP rank must hold exactly that rank's heads.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relax_hpc.errors import UserError
from relax_hpc.trainer.megatron import mapping as M
from relax_hpc.trainer.megatron.config import check_layout, check_ranks, ddp_args, model_args, optimizer_args

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def tiny_hf(arch: str, *, tied: bool, vocab: int = 101, heads: int = 4, kv_heads: int = 2, layers: int = 2) -> tuple:
    """(HF config dict, HF state dict) of a tiny random model of ``arch`` (qwen3 or qwen2 = Qwen2.5)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls_cfg, cls_model = (Qwen3Config, Qwen3ForCausalLM) if arch == "qwen3" else (Qwen2Config, Qwen2ForCausalLM)
    extra = {"head_dim": 8} if arch == "qwen3" else {}
    config = cls_cfg(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                     max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    model = cls_model(config)
    with torch.no_grad():  # norms are ones at init: make them distinct so a swapped norm would show
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight", None)  # what save_pretrained writes for a tied model
    return config.to_dict(), sd


def split(sd: dict, shape: M.ModelShape, tp: int, pp: int, **kw) -> list[list[dict]]:
    return [[M.hf_to_megatron(sd, shape, tp=tp, tp_rank=r, pp=pp, pp_rank=s, **kw) for r in range(tp)]
            for s in range(pp)]


CASES = [(arch, tied, tp, pp) for arch in ("qwen3", "qwen2") for tied in (True, False) for tp in (1, 2)
         for pp in (1, 2)]


@pytest.mark.parametrize(("arch", "tied", "tp", "pp"), CASES)
def test_round_trip_is_bitwise(arch: str, tied: bool, tp: int, pp: int) -> None:
    hf, sd = tiny_hf(arch, tied=tied)
    shape = M.ModelShape.from_hf(hf)
    assert shape.num_kv_heads < shape.num_heads
    shards = split(sd, shape, tp, pp)
    back = M.megatron_to_hf(shards, shape)
    assert sorted(back) == sorted(sd)
    for k, v in sd.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape, k
        assert torch.equal(back[k], v), k
    # every shard owns its storage (no view into the HF tensors), and the vocabulary is padded evenly
    padded = M.padded_vocab_size(shape.vocab_size, tp)
    assert padded % (128 * tp) == 0 and padded >= shape.vocab_size
    for stage in shards:
        for rank_sd in stage:
            for t in rank_sd.values():
                assert all(t.untyped_storage().data_ptr() != v.untyped_storage().data_ptr() for v in sd.values())
    emb = shards[0][-1][M.EMBED]
    assert emb.shape[0] == padded // tp and torch.count_nonzero(emb[shape.vocab_size - padded // tp * (tp - 1):]) == 0


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_megatron_names_are_megatron_cores(arch: str) -> None:
    """The names megatron-core's GPTModel (local spec, RMSNorm, qk_layernorm for Qwen3) has on each stage."""
    hf, sd = tiny_hf(arch, tied=False)
    shape = M.ModelShape.from_hf(hf)
    layer = ["input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
             "pre_mlp_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    layer += (["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"] if arch == "qwen3"
              else ["self_attention.linear_qkv.bias"])
    first = M.hf_to_megatron(sd, shape, pp=2, pp_rank=0)
    last = M.hf_to_megatron(sd, shape, pp=2, pp_rank=1)
    assert sorted(first) == sorted([f"decoder.layers.0.{n}" for n in layer] + ["embedding.word_embeddings.weight"])
    assert sorted(last) == sorted([f"decoder.layers.0.{n}" for n in layer]
                                  + ["decoder.final_layernorm.weight", "output_layer.weight"])
    assert torch.equal(last["decoder.layers.0.mlp.linear_fc2.weight"], sd["model.layers.1.mlp.down_proj.weight"])
    fused = M.hf_to_megatron(sd, shape, fused_norms=True)
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in fused
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in fused
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in fused)
    assert torch.equal(M.megatron_to_hf([[fused]], shape, fused_norms=True)["model.layers.1.input_layernorm.weight"],
                       sd["model.layers.1.input_layernorm.weight"])


def test_tied_last_stage_holds_the_embedding_copy() -> None:
    hf, sd = tiny_hf("qwen3", tied=True)
    shape = M.ModelShape.from_hf(hf)
    assert "output_layer.weight" not in M.hf_to_megatron(sd, shape)  # one stage: the embedding is shared
    last = M.hf_to_megatron(sd, shape, tp=2, tp_rank=1, pp=2, pp_rank=1)
    first = M.hf_to_megatron(sd, shape, tp=2, tp_rank=1, pp=2, pp_rank=0)
    assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
@pytest.mark.parametrize(("heads", "kv_heads", "tp"), [(4, 2, 2), (8, 2, 2), (8, 4, 4), (4, 4, 2)])
def test_qkv_shard_holds_exactly_its_ranks_heads(arch: str, heads: int, kv_heads: int, tp: int) -> None:
    hf, sd = tiny_hf(arch, tied=False, heads=heads, kv_heads=kv_heads, layers=1)
    shape = M.ModelShape.from_hf(hf)
    d, per_group, groups_per_rank = shape.head_dim, heads // kv_heads, kv_heads // tp
    a = "model.layers.0.self_attn."
    for r in range(tp):
        rank_sd = M.hf_to_megatron(sd, shape, tp=tp, tp_rank=r)
        for suffix in ("weight", "bias") if arch == "qwen2" else ("weight",):
            q, k, v = (sd[f"{a}{p}_proj.{suffix}"] for p in "qkv")
            fused = rank_sd[f"decoder.layers.0.self_attention.linear_qkv.{suffix}"]
            assert fused.shape[0] == groups_per_rank * (per_group + 2) * d
            blocks = fused.reshape(groups_per_rank, per_group + 2, d, *fused.shape[1:])
            for j in range(groups_per_rank):
                g = r * groups_per_rank + j
                assert torch.equal(blocks[j, :per_group].reshape(-1, *q.shape[1:]),
                                   q[g * per_group * d:(g + 1) * per_group * d])
                assert torch.equal(blocks[j, per_group], k[g * d:(g + 1) * d])
                assert torch.equal(blocks[j, per_group + 1], v[g * d:(g + 1) * d])


def test_fc1_and_row_parallel_shards() -> None:
    hf, sd = tiny_hf("qwen3", tied=False, layers=1)
    shape = M.ModelShape.from_hf(hf)
    m = "model.layers.0.mlp."
    ffn = shape.intermediate_size
    for r in range(2):
        rank_sd = M.hf_to_megatron(sd, shape, tp=2, tp_rank=r)
        fc1 = rank_sd["decoder.layers.0.mlp.linear_fc1.weight"]
        gate, up = fc1.chunk(2, dim=0)
        assert torch.equal(gate, sd[m + "gate_proj.weight"][r * ffn // 2:(r + 1) * ffn // 2])
        assert torch.equal(up, sd[m + "up_proj.weight"][r * ffn // 2:(r + 1) * ffn // 2])
        assert torch.equal(rank_sd["decoder.layers.0.mlp.linear_fc2.weight"],
                           sd[m + "down_proj.weight"][:, r * ffn // 2:(r + 1) * ffn // 2])
        o = sd["model.layers.0.self_attn.o_proj.weight"]
        cols = o.shape[1] // 2
        assert torch.equal(rank_sd["decoder.layers.0.self_attention.linear_proj.weight"],
                           o[:, r * cols:(r + 1) * cols])


def test_model_args_from_hf_config() -> None:
    hf, _ = tiny_hf("qwen2", tied=False)
    args = model_args(hf, tp=2, pp=2)
    t = args.transformer
    assert (t["num_layers"], t["hidden_size"], t["num_attention_heads"], t["num_query_groups"]) == (2, 32, 4, 2)
    assert t["kv_channels"] == 8 and t["ffn_hidden_size"] == 48 and t["add_qkv_bias"] and not t["qk_layernorm"]
    assert t["tensor_model_parallel_size"] == 2 and t["pipeline_model_parallel_size"] == 2
    assert args.gpt["vocab_size"] == 256 and args.gpt["share_embeddings_and_output_weights"] is False
    assert args.gpt["rotary_base"] == int(hf["rope_parameters"]["rope_theta"]) and args.activation == "silu"
    assert (args.gpt["pre_process"], args.gpt["post_process"]) == (True, False)  # stage 0 of 2: the embedding
    last = model_args(hf, tp=2, pp=2, pp_rank=1).gpt
    assert (last["pre_process"], last["post_process"]) == (False, True)  # the final norm and the output layer
    q3 = model_args(tiny_hf("qwen3", tied=True)[0])
    assert q3.gpt["pre_process"] and q3.gpt["post_process"]
    assert q3.transformer["qk_layernorm"] and not q3.transformer["add_qkv_bias"]
    assert q3.gpt["share_embeddings_and_output_weights"] is True and q3.gpt["vocab_size"] == 128
    json.dumps([args.transformer, args.gpt])  # plain data


def test_bad_layouts_name_the_fix() -> None:
    shape = M.ModelShape.from_hf(tiny_hf("qwen3", tied=True, heads=6, kv_heads=2, layers=3)[0])
    with pytest.raises(UserError, match=r"tp=4 does not divide the model's 6 attention heads; use a tp that"):
        check_layout(shape, tp=4, pp=1)
    with pytest.raises(UserError, match=r"tp=3 does not divide the model's 2 key/value heads"):
        check_layout(shape, tp=3, pp=1)
    with pytest.raises(UserError, match=r"pp=2 does not divide the model's 3 layers; use a pp that divides 3"):
        check_layout(shape, tp=1, pp=2)
    with pytest.raises(UserError, match=r"num_ranks=6 is not a multiple of tp\*pp=4"):
        check_ranks(6, tp=2, pp=2)
    check_layout(shape, tp=2, pp=3)
    check_ranks(12, tp=2, pp=3)
    with pytest.raises(UserError, match=r"model_type 'llama' has no megatron weight mapping \(mapped: qwen2, qwen3\)"):
        check_layout(M.ModelShape.from_hf({**tiny_hf("qwen3", tied=True)[0], "model_type": "llama"}), tp=1, pp=1)
    with pytest.raises(UserError, match="rope type 'yarn' has no megatron mapping"):
        model_args({**tiny_hf("qwen3", tied=True)[0], "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}})


def _validate(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data: {task: {name: reverse_digits}}\nmodel: {path: tiny}\ntrainer: {backend: megatron}\n")
    cmd = [sys.executable, "-m", "relax_hpc", "validate", str(recipe)]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_validate_refuses_a_bad_megatron_recipe_in_one_line(tmp_path: Path) -> None:
    bad = _validate(tmp_path, "trainer.megatron.tp=3")
    assert bad.returncode == 2, bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "trainer.megatron.tp=3 does not divide the model's 4 attention heads" in lines[0]
    assert "Traceback" not in bad.stderr
    pp = _validate(tmp_path, "trainer.megatron.pp=3")
    assert pp.returncode == 2 and "pp=3 does not divide the model's 2 layers" in pp.stderr
    vl = _validate(tmp_path, "model.tiny.arch=qwen2_5_vl")
    assert vl.returncode == 2 and "model_type 'qwen2_5_vl' has no megatron weight mapping" in vl.stderr
    good = _validate(tmp_path, "trainer.megatron.tp=2", "trainer.num_ranks=2")
    if HAVE_MCORE:
        assert good.returncode == 0, good.stderr
        stages = _validate(tmp_path, "trainer.megatron.pp=2", "trainer.num_ranks=2")  # pipeline stages validate
        assert stages.returncode == 0, stages.stderr
    else:
        assert good.returncode == 2 and len(good.stderr.strip().splitlines()) == 1
        assert "megatron-core, which is not installed: pip install megatron-core" in good.stderr


def test_a_local_model_folder_is_checked_from_its_config_json(tmp_path: Path) -> None:
    from relax_hpc.config.load import validate_dict
    from relax_hpc.trainer.checks import check_trainer

    hf, _ = tiny_hf("qwen2", tied=False, heads=4, kv_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    recipe = {"data": {"task": {"name": "reverse_digits"}}, "model": {"path": str(tmp_path)},
              "trainer": {"backend": "megatron", "megatron": {"tp": 4}}}
    with pytest.raises(UserError, match="tp=4 does not divide the model's 2 key/value heads"):
        check_trainer(validate_dict(recipe))  # the backend registry checks the layout, not the schema


def test_optimizer_and_ddp_args_follow_the_trainer_section() -> None:
    from relax_hpc.config.schema import MegatronTrainerConfig

    t = MegatronTrainerConfig(lr=3e-6, weight_decay=0.1, betas=(0.9, 0.95), grad_clip=0.5,
                      megatron={"tp": 2, "distributed_optimizer": False})
    assert optimizer_args(t) == {"optimizer": "adam", "lr": 3e-6, "weight_decay": 0.1, "adam_beta1": 0.9,
                                 "adam_beta2": 0.95, "clip_grad": 0.5, "use_distributed_optimizer": False}
    assert ddp_args(t)["use_distributed_optimizer"] is False
    assert ddp_args(MegatronTrainerConfig())["use_distributed_optimizer"] is True


def _tp_forward(shards: list[dict], shape: M.ModelShape, ids: torch.Tensor, model, qk_norm: bool) -> torch.Tensor:
    """Logits of the model from its TP shards, computed the way megatron-core's tensor-parallel layers do: each rank
    reads its q/k/v as ``view(groups_local, (heads_per_group + 2) * head_dim)`` of its ``linear_qkv`` output, its
    gate/up as ``chunk(2)`` of its ``linear_fc1`` output; row-parallel outputs are summed over ranks (the all-reduce),
    vocabulary shards concatenated. Only RoPE comes from the HF module."""
    import torch.nn.functional as F
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    eps = model.config.rms_norm_eps
    d, hpg = shape.head_dim, shape.num_heads // shape.num_kv_heads
    pos = torch.arange(ids.shape[1])[None]
    x = F.embedding(ids, torch.cat([s[M.EMBED] for s in shards]))
    cos, sin = model.model.rotary_emb(x, pos)

    def norm(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))

    for i in range(shape.num_layers):
        p = f"decoder.layers.{i}."
        h = norm(x, shards[0][p + "input_layernorm.weight"])
        attn = 0
        for s in shards:
            qkv = F.linear(h, s[p + "self_attention.linear_qkv.weight"], s.get(p + "self_attention.linear_qkv.bias"))
            qkv = qkv.view(*h.shape[:2], -1, (hpg + 2) * d)
            q, k, v = qkv.split([hpg * d, d, d], dim=-1)
            q = q.reshape(*h.shape[:2], -1, d)
            if qk_norm:
                q = norm(q, s[p + "self_attention.q_layernorm.weight"])
                k = norm(k, s[p + "self_attention.k_layernorm.weight"])
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            attn = attn + F.linear(o.transpose(1, 2).flatten(2), s[p + "self_attention.linear_proj.weight"])
        x = x + attn
        h = norm(x, shards[0][p + "pre_mlp_layernorm.weight"])
        mlp = 0
        for s in shards:
            gate, up = F.linear(h, s[p + "mlp.linear_fc1.weight"]).chunk(2, dim=-1)
            mlp = mlp + F.linear(F.silu(gate) * up, s[p + "mlp.linear_fc2.weight"])
        x = x + mlp
    x = norm(x, shards[0][M.FINAL_NORM])
    head = M.EMBED if shape.tied else M.OUTPUT
    return torch.cat([F.linear(x, s[head]) for s in shards], dim=-1)[..., : shape.vocab_size]


@pytest.mark.parametrize(("arch", "tied"), [("qwen3", True), ("qwen2", False)])
def test_tp2_shards_compute_the_hf_logits(arch: str, tied: bool) -> None:
    """The layout is the one megatron-core computes with, not only self-consistent: the TP=2 shards, used the way
    megatron's parallel layers use them, give the HF model's logits (float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf, sd = tiny_hf(arch, tied=tied, heads=8, kv_heads=2)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf)).eval()
    loaded = model.load_state_dict(sd, strict=False)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= ({"lm_head.weight"} if tied else set())
    if tied:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    shape = M.ModelShape.from_hf(hf)
    shards = split(sd, shape, 2, 1)[0]
    ids = torch.randint(0, shape.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
        got = _tp_forward(shards, shape, ids, model, qk_norm=arch == "qwen3")
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)



def test_each_layer_has_one_stage() -> None:
    shape = M.ModelShape.from_hf(tiny_hf("qwen3", tied=True, layers=6)[0])
    for pp in (1, 2, 3, 6):
        owners = [M.layer_stage(shape, pp, i) for i in range(6)]
        assert owners == [s for s in range(pp) for _ in M.stage_layers(shape, pp, s)]
