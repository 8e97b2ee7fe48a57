"""``relax-hpc bench trainer``: tokens/s and padding of the torch trainer vs plain HF fwd+bwd, same run, same data.

``--backend megatron`` adds the megatron backend (megatron-core, TP=1, one rank) on the same sequences after the
torch backend, and prints tokens/s, MFU and peak memory of both (GPU: ``torch.cuda.max_memory_allocated`` of each
phase; CPU: the process's peak RSS after each phase, cumulative; MFU only on a GPU or with ``--peak-tflops``).

Data: ``--batch`` sequences with lengths drawn uniformly in [seq_len/2, seq_len] (RL responses vary), a quarter
prompt, the rest response. Baseline: plain HF ``model(input_ids, labels)`` fwd+bwd + AdamW on right-padded
[batch, max_len] tensors (what most RL trainers do per micro-batch). Ours: :meth:`TorchTrainer.train_step` on the
same sequences (packed, no padding, logits only at response positions, GRPO loss). tokens/s counts real tokens only;
MFU = 6 * params * tokens/s / peak (dense bf16 peak of the GPU, ``--peak-tflops``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.bench.common import print_fields

SHAPES = {
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
             "vocab": 18, "max_position": 4096},
    "qwen3-0.6b": {"hidden_size": 1024, "num_layers": 28, "num_heads": 16, "num_kv_heads": 8,
                   "intermediate_size": 3072, "vocab": 151936, "max_position": 40960},
    "qwen3-4b": {"hidden_size": 2560, "num_layers": 36, "num_heads": 32, "num_kv_heads": 8,
                 "intermediate_size": 9728, "vocab": 151936, "max_position": 40960},
}


def build(shape: str, device: str, dtype: Any) -> Any:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    s = SHAPES[shape]
    cfg = Qwen3Config(vocab_size=s["vocab"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
                      num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
                      num_key_value_heads=s["num_kv_heads"], head_dim=128 if shape != "tiny" else 16,
                      max_position_embeddings=s["max_position"], tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype)


def make_lengths(batch: int, seq_len: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(seq_len // 2, seq_len + 1, size=batch)]


def bench_plain_hf(model: Any, lengths: list[int], vocab: int, device: str, iters: int,
                   warmup: int = 1) -> dict[str, float]:
    import torch

    B, L = len(lengths), max(lengths)
    ids = torch.randint(3, vocab, (B, L), device=device)
    attn = torch.zeros((B, L), dtype=torch.long, device=device)
    labels = torch.full((B, L), -100, dtype=torch.long, device=device)
    for i, n in enumerate(lengths):
        attn[i, :n] = 1
        labels[i, n // 4:n] = ids[i, n // 4:n]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=device != "cpu")

    def step() -> None:
        out = model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    dt = _timed(step, iters, device, warmup)
    real = sum(lengths)
    return {"tokens_per_s": real / dt, "step_s": dt, "padding_fraction": 1 - real / (B * L)}


def make_items(lengths: list[int], vocab: int) -> list[Any]:
    """The GRPO train items of the benchmark: a quarter prompt, the rest response, random advantages."""
    from relax_hpc.trainer.batch import TrainItem

    rng = np.random.default_rng(1)
    items = []
    for n in lengths:
        p = n // 4
        items.append(TrainItem.of(prompt_ids=rng.integers(3, vocab, p), response_ids=rng.integers(3, vocab, n - p),
                               logprobs=np.full(n - p, -3.0, dtype=np.float32), loss_mask=np.ones(n - p),
                               advantage=float(rng.normal())))
    return items


def _bench_cfg(micro_tokens: int, backend: str, switches: dict[str, bool] | None = None) -> Any:
    """The benchmark's recipe; ``switches``: trainer fields (``compile_layers``, ``fused_head``) for both backends."""
    from relax_hpc.config.load import validate_dict

    return validate_dict({"data": {"task": {"name": "reverse_digits"}},
                          "trainer": {"lr": 1e-5, "micro_batch_tokens": micro_tokens, "device": "cpu",
                                      "backend": backend, **(switches or {})}})


def bench_backend(tr: Any, items: list[Any], device: str, iters: int, warmup: int = 1,
                  profile: Path | None = None) -> dict[str, Any]:
    """tokens/s of ``tr.train_step(items)`` (a trainer backend); with ``profile`` one more step under
    torch.profiler, its table (by GPU time) written there."""
    box: dict[str, Any] = {}

    def step() -> None:
        box["m"] = tr.train_step(items)

    dt = _timed(step, iters, device, warmup)
    m = box["m"]
    out = {"tokens_per_s": sum(it.num_tokens for it in items) / dt, "step_s": dt,
           "padding_fraction": m["train/padding_fraction"], "micro_batches": m["train/num_micro_batches"]}
    if profile is not None:
        out["profiled_gpu_busy"] = _profiled(step, device, profile)
    return out


def _profiled(fn: Any, device: str, path: Path) -> float:
    """One call of ``fn`` under torch.profiler: its table (top 40 by GPU time, CPU time off a GPU) written to
    ``path``; returns the share of the call's wall time the GPU kernels took (summed; 0 on the CPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(events.table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=40,
                                 max_name_column_width=70) + f"\nwall {wall * 1e3:.1f} ms\n")
    kernel_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events) if cuda else 0.0
    return kernel_us / 1e6 / wall


def bench_ours(model: Any, lengths: list[int], vocab: int, device: str, iters: int, micro_tokens: int,
               warmup: int = 1, switches: dict[str, bool] | None = None, profile: Path | None = None) -> dict:
    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.trainer.torch_trainer import TorchTrainer

    tr = TorchTrainer(_bench_cfg(micro_tokens, "torch", switches), model, device=device,
                      dtype=next(model.parameters()).dtype, algorithm=get_algorithm("grpo"))
    return bench_backend(tr, make_items(lengths, vocab), device, iters, warmup, profile)


def bench_megatron(model: Any, lengths: list[int], vocab: int, device: str, iters: int, micro_tokens: int,
                   warmup: int = 1, switches: dict[str, bool] | None = None, profile: Path | None = None) -> dict:
    """The megatron backend (TP=1, one in-process rank) built from ``model``'s weights (moved to the CPU first, so
    the phase's peak memory is the megatron model's own)."""
    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.trainer.megatron.backend import build

    dtype = next(model.parameters()).dtype
    for p in model.parameters():
        p.grad = None
    model.to("cpu")
    tr = build(_bench_cfg(micro_tokens, "megatron", switches), rank=0, world_size=1, device=device, dtype=dtype,
               algorithm=get_algorithm("grpo"), tokenizer=None, model=model)
    res = bench_backend(tr, make_items(lengths, vocab), device, iters, warmup, profile)
    res["optimizer"] = type(tr.optimizer).__name__  # ChainedOptimizer: megatron's distributed optimizer
    return res


def _peak_memory_gb(device: str) -> float:
    """The phase's peak device memory (GPU), or the process's peak RSS so far (CPU)."""
    import resource

    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _timed(fn: Any, iters: int, device: str, warmup: int = 1) -> float:
    """Seconds per call of ``fn`` over ``iters`` calls, after ``warmup`` untimed calls."""
    import torch

    for _ in range(warmup):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(prog="relax-hpc bench trainer", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="tiny on CPU, qwen3-0.6b on GPU (default)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed steps of each path before its --iters timed ones (default 1)")
    p.add_argument("--micro-batch-tokens", type=int, default=None)
    p.add_argument("--attn", default=None, help="attention kernel of our trainer (default: flex_attention on GPU, "
                   "sdpa on CPU); the plain HF baseline always uses sdpa")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak for MFU (default on a GPU: 989, H100/H200; on the CPU no MFU unless given)")
    p.add_argument("--backend", choices=["torch", "megatron"], default="torch",
                   help="megatron: also the megatron backend (TP=1) on the same data, after the torch backend")
    p.add_argument("--compile-layers", action="store_true", help="trainer.compile_layers on, for both backends")
    p.add_argument("--fused-head", action="store_true", help="trainer.fused_head on, for both backends")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="one more step of each backend under torch.profiler: DIR/torch.txt, DIR/megatron.txt")
    a = p.parse_args(argv)
    switches = {"compile_layers": a.compile_layers, "fused_head": a.fused_head}
    prof = {k: a.profile / f"{k}.txt" if a.profile else None for k in ("torch", "megatron")}
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    shape = a.shape or ("qwen3-0.6b" if cuda else "tiny")
    batch = a.batch or (8 if cuda else 64)
    seq_len = a.seq_len or (2048 if cuda else 64)
    iters = a.iters or (5 if cuda else 10)
    micro = a.micro_batch_tokens or (batch * seq_len // 2 if cuda else 4096)
    dtype = torch.bfloat16 if cuda else torch.float32
    lengths = make_lengths(batch, seq_len)
    vocab = SHAPES[shape]["vocab"]
    model = build(shape, device, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    plain = bench_plain_hf(model, lengths, vocab, device, iters, a.warmup)
    _reset_peak(device)
    attn = a.attn or ("flex_attention" if cuda else "sdpa")
    model.set_attn_implementation(attn)
    ours = bench_ours(model, lengths, vocab, device, iters, micro, a.warmup, switches, prof["torch"])
    ours["peak_memory_gb"] = _peak_memory_gb(device)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu", "shape": shape, "params": n_params,
        "batch": batch, "seq_len": seq_len, "real_tokens": sum(lengths), "iters": iters, "warmup": a.warmup,
        "tokens_per_s": ours["tokens_per_s"], "padding_fraction": ours["padding_fraction"],
        "micro_batches": ours["micro_batches"], "plain_hf_tokens_per_s": plain["tokens_per_s"],
        "plain_hf_padding_fraction": plain["padding_fraction"],
        "speedup_vs_plain_hf": ours["tokens_per_s"] / plain["tokens_per_s"], "attn_implementation": attn,
        **switches, **({"profiled_gpu_busy": ours["profiled_gpu_busy"]} if a.profile else {}),
    }
    peak = (a.peak_tflops or 989.0) * 1e12 if cuda or a.peak_tflops else None
    if peak:
        out["mfu"] = 6 * n_params * ours["tokens_per_s"] / peak
        out["plain_hf_mfu"] = 6 * n_params * plain["tokens_per_s"] / peak
    out["peak_memory_gb" if cuda else "peak_rss_gb"] = ours["peak_memory_gb"]
    if a.backend == "megatron":
        _reset_peak(device)
        meg = bench_megatron(model, lengths, vocab, device, iters, micro, a.warmup, switches, prof["megatron"])
        out.update({"megatron_tokens_per_s": meg["tokens_per_s"], "megatron_micro_batches": meg["micro_batches"],
                    "megatron_optimizer": meg["optimizer"],
                    "megatron_vs_torch": meg["tokens_per_s"] / ours["tokens_per_s"],
                    ("megatron_peak_memory_gb" if cuda else "megatron_peak_rss_gb"): _peak_memory_gb(device)})
        if a.profile:
            out["megatron_profiled_gpu_busy"] = meg["profiled_gpu_busy"]
        if peak:
            out["megatron_mfu"] = 6 * n_params * meg["tokens_per_s"] / peak
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print_fields(out, width=28)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
