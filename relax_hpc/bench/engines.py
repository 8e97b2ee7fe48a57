"""``relax-hpc bench engines``: a server engine (``vllm`` or ``sglang``) against the ``hf`` engine, same model, same
prompts, same run.

Builds the recipe's model once, saves it as the server's HF folder, starts the server (its start time is reported),
then generates the same prompt batches (``rollout.batch_prompts`` prompts x ``rollout.n_samples`` samples, the
recipe's sampling) with the hf engine and the server engine alternately, batch by batch, and prints generated
tokens/s of each and ``speedup`` = server tokens/s / hf tokens/s. Default recipe: the demo task with a tiny Qwen3 of
a shape vLLM's CPU backend accepts (``DEFAULT_OVERRIDES``)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from relax_hpc.bench.common import DEMO_RECIPE, machine, measure_and_print

DEFAULT_OVERRIDES = [
    "rollout.engine=vllm", "model.tiny.hidden_size=128", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
    "model.tiny.intermediate_size=256", "model.tiny.max_position=256", "model.tiny.tie_embeddings=false",
    "model.dtype=float32", "rollout.sampling.max_new_tokens=64",
]


def start_server_engine(cfg: Any, root: Path, tok: Any) -> tuple[Any, Any, float]:
    """(engine, a LoopThread-like runner, start seconds) for ``cfg.rollout.engine`` with a run dir under ``root``."""
    from relax_hpc.rollout.server import make_server_engine
    from relax_hpc.rundir import RunDir

    rd = RunDir.create(root / "run")
    engine = make_server_engine(cfg, run_dir=rd, proc="bench-0", device="cpu", seed=cfg.seed, tokenizer=tok)
    runner = Runner()
    t0 = time.perf_counter()
    runner.run(engine.ensure_started(), timeout=cfg.rollout.server.startup_timeout_s + 60)
    return engine, runner, time.perf_counter() - t0


class Runner:
    """An event loop on a thread (the engine's HTTP client lives in it)."""

    def __init__(self) -> None:
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 600.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _requests(batch: list[Any], cfg: Any, i: int) -> list[Any]:
    from relax_hpc.rollout.engine import GenerateRequest, SamplingParams

    s = cfg.rollout.sampling
    sp = SamplingParams(n=cfg.rollout.n_samples, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                        max_new_tokens=s.max_new_tokens)
    return [GenerateRequest(request_id=f"b{i}-{k}", prompt_ids=list(p.prompt_ids), sampling=sp)
            for k, p in enumerate(batch)]


def measure(recipe: Path, overrides: list[str], *, batches: int, warmup: int, threads: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from relax_hpc.config.load import load_recipe
    from relax_hpc.models.load import load_tokenizer
    from relax_hpc.modes import components as C
    from relax_hpc.rollout.engine import generate_all
    from relax_hpc.rollout.hf_engine import from_config

    torch.set_num_threads(threads)
    cfg = load_recipe(recipe, overrides)
    if cfg.rollout.engine == "hf":
        raise ValueError("bench engines compares a server engine with hf: set rollout.engine=vllm or sglang")
    tok = load_tokenizer(cfg.model)
    with tempfile.TemporaryDirectory(prefix="relax-bench-engines-") as tmp:
        engine, runner, start_s = start_server_engine(cfg, Path(tmp), tok)
        try:
            model = AutoModelForCausalLM.from_pretrained(engine.setup.model_dir, dtype=torch.float32).eval()
            hf = from_config(cfg, device="cpu", seed=cfg.seed, tokenizer=tok, model=model)  # the same weights
            stream = C.build_prompt_stream(cfg, tok)
            rates: dict[str, list[float]] = {"hf": [], "server": []}
            for i in range(warmup + batches):
                batch = stream.next_batch(cfg.rollout.batch_prompts)
                t0 = time.perf_counter()
                out = runner.run(generate_all(hf, _requests(batch, cfg, i)))
                hf_s, hf_tok = time.perf_counter() - t0, sum(len(s.token_ids) for r in out for s in r.samples)
                t0 = time.perf_counter()
                res = runner.run(generate_all(engine, _requests(batch, cfg, i)))
                sv_s, sv_tok = time.perf_counter() - t0, sum(len(s.token_ids) for r in res for s in r.samples)
                if i >= warmup:
                    rates["hf"].append(hf_tok / hf_s)
                    rates["server"].append(sv_tok / sv_s)
            runner.run(hf.close(), timeout=60)
        finally:
            runner.run(engine.close(), timeout=120)
            runner.close()
    kind = cfg.rollout.engine
    out: dict[str, Any] = {
        "benchmark": "engines", "engine": kind, "recipe": str(recipe), "overrides": overrides, "threads": threads,
        "batches": batches, "batch": f"{cfg.rollout.batch_prompts} prompts x {cfg.rollout.n_samples} samples, "
                                     f"max_new_tokens {cfg.rollout.sampling.max_new_tokens}",
        "server_start_s": round(start_s, 1),
        "hf_tokens_per_s_median": statistics.median(rates["hf"]),
        f"{kind}_tokens_per_s_median": statistics.median(rates["server"]),
    }
    out["speedup"] = out[f"{kind}_tokens_per_s_median"] / out["hf_tokens_per_s_median"]
    out["machine"] = machine()
    return out


def main(argv: list[str] | None = None) -> int:


    p = argparse.ArgumentParser(prog="relax-hpc bench engines", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--recipe", default=str(DEMO_RECIPE), help="recipe (default: recipes/demo.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=None, metavar="KEY=VALUE",
                   help="override a recipe field (repeatable); default: " + " ".join(DEFAULT_OVERRIDES))
    p.add_argument("--batches", type=int, default=10, help="timed batches of each engine")
    p.add_argument("--warmup", type=int, default=2, help="untimed batches first")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of the hf engine")
    a = p.parse_args(argv)
    if a.batches < 1 or a.warmup < 0 or a.threads < 1:
        p.error("--batches and --threads must be >= 1, --warmup >= 0")
    recipe = Path(a.recipe)
    overrides = DEFAULT_OVERRIDES if a.overrides is None else [*DEFAULT_OVERRIDES, *a.overrides]
    return measure_and_print(recipe, lambda: measure(recipe, overrides, batches=a.batches, warmup=a.warmup,
                                                     threads=a.threads), as_json=a.json)


if __name__ == "__main__":
    raise SystemExit(main())
