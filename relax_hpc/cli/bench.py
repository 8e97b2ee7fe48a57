"""``relax-hpc bench NAME [--json] [...]``: benchmarks that print figures (ratios to a baseline measured in the same
run). Each is a module ``relax_hpc.bench.<name>`` with ``main(argv) -> int``."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "store": "sample store write/read vs raw disk bandwidth",
    "snapshots": "weight snapshot publish/load vs raw disk bandwidth",
    "trainer": "trainer tokens/s and padding fraction",
    "pipeline": "colocate vs fully_async on the demo recipe",
    "learning": "colocate vs fully_async final reward over seeds",
    "generate": "the hf engine's sampling loop vs transformers generate",
    "monitor": "monitor refresh time on a large run",
    "slurm": "submit and status latency against a real Slurm",
    "chaos": "random SIGKILLs, requeues and step cancels of fully_async runs on Slurm; the store's accounting",
    "preprocess": "media preprocessing in the processor pool vs inline, and the rollout wait for it",
    "engines": "a server engine (vllm, sglang) vs the hf engine, same prompts, tokens/s",
    "weights": "server engine weight-update latency per path and the generation pause it causes",
    "step": "the colocate loop on a real model shape on one GPU, with TRL and transformers.generate",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(BENCHES), help="; ".join(f"{k}: {v}" for k, v in BENCHES.items()))
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the benchmark (e.g. --json)")


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"relax_hpc.bench.{args.name}")
    return int(module.main(list(args.args)) or 0)
