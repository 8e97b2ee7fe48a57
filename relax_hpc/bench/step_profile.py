"""torch.profiler tables for ``bench step --profile DIR``: where the time goes in one generation call (per decode
step) and in one training step, on the benchmark's model and batch shape (tables by GPU time, top 40 rows)."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np


def _table(prof: Any, path: Path, rows: int = 40) -> None:
    import torch

    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70))


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_phases(rec: dict[str, Any], out: Path, a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from relax_hpc.config.load import validate_dict
    from relax_hpc.modes import components as C
    from relax_hpc.rollout.engine import GenerateRequest, generate_all
    from relax_hpc.rollout.hf_engine import sampling_params
    from relax_hpc.trainer.batch import TrainItem
    from relax_hpc.trainer.torch_trainer import TorchTrainer

    out.mkdir(parents=True, exist_ok=True)
    cfg = validate_dict(rec)
    policy = C.build_policy(cfg, device_pref=a.device)
    engine = C.build_engine(cfg, policy.tokenizer, seed=cfg.seed, model=policy.model, device=policy.device)
    prompts = [p.prompt_ids for p in C.build_prompt_stream(cfg, policy.tokenizer).next_batch(a.prompts)]
    sampling = sampling_params(cfg.rollout.sampling, a.samples)
    loop = asyncio.new_event_loop()

    def generate(tag: str) -> list[Any]:
        reqs = [GenerateRequest(f"{tag}-{k}", p, sampling) for k, p in enumerate(prompts)]
        return [s for r in loop.run_until_complete(generate_all(engine, reqs)) for s in r.samples]

    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
    generate("warmup")  # graphs captured
    _sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        samples = generate("profiled")
        _sync()
        gen_s = time.perf_counter() - t0
    loop.run_until_complete(engine.close())
    loop.close()
    _table(prof, out / "decode_profile.txt")
    steps = max(len(s.token_ids) for s in samples)
    rng = np.random.default_rng(0)
    items = [TrainItem.of(prompt_ids=np.asarray(p), response_ids=rng.integers(0, 151643, a.new_tokens),
                       logprobs=np.full(a.new_tokens, -12.0, dtype=np.float32),
                       loss_mask=np.ones(a.new_tokens), advantage=float(rng.normal()))
             for p in prompts for _ in range(a.samples)]
    trainer = TorchTrainer(cfg, policy.model, device=policy.device, dtype=policy.dtype,
                           algorithm=C.build_algorithm(cfg))
    trainer.train_step(items)
    _sync()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        trainer.train_step(items)
        _sync()
        train_s = time.perf_counter() - t0
    _table(prof, out / "train_profile.txt")
    return {"decode_ms_per_step": 1000 * gen_s / max(1, steps), "profiled_generate_s": gen_s,
            "profiled_train_step_s": train_s, "tables": str(out)}
