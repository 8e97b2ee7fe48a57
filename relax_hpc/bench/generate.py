"""``relax-hpc bench generate``: the ``hf`` engine's sampling loop against ``transformers.generate``, same model.
With ``--set rollout.engine=vllm`` (or ``sglang``) it runs ``relax-hpc bench engines``: that server engine against the
hf engine on the same prompts (:mod:`relax_hpc.bench.engines`).

Builds the recipe's policy (default: the demo's tiny model), then times ``engine.generate`` on the same prompt
batches (``rollout.batch_prompts`` prompts x ``rollout.n_samples`` samples, the recipe's sampling settings) with
``rollout.hf_decoder: auto`` (the loop) and ``generate``, alternating batch by batch so that both see the same
machine. Prints the median and minimum ms per batch of each and ``speedup`` = generate median / loop median, with
the mean response length of each (the two sample from the same distribution, so these should agree).

With ``--lengths MIX`` (:mod:`relax_hpc.bench.lengths`: ``uniform``, ``lognormal:mean=512,sigma=1.0,cap=4096``,
``file:lengths.json``; each request's ``max_new_tokens`` drawn from it) it measures what a fully_async worker
sees: the requests of all ``--batches`` batches are submitted at once and each decoder of ``--decoders`` (default
``auto,slots``: static batches of the loop, and the slot pool that keeps its ``batch_prompts x n_samples`` rows
full) generates them all; per decoder: generation tokens/s, the decode-step occupancy (mean active rows / rows),
the seconds decoding with < 25 % of the rows active, the response lengths (p50, p99, mean) and the critical path
(the longest response). The decoder ``vllm`` is the peer: vLLM's offline ``LLM.generate`` in this process (the
``vllm`` package importable here, a GPU), the same requests with the same drawn budgets, the model folder in the
recipe's dtype, CUDA graphs unless ``--vllm-eager``, ``--vllm-memory`` of the GPU's memory for weights and KV cache.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from relax_hpc.bench.common import DEMO_RECIPE, machine, measure_and_print


def measure(recipe: Path, overrides: list[str], *, batches: int, warmup: int, threads: int) -> dict[str, Any]:
    import torch

    from relax_hpc.config.load import load_recipe
    from relax_hpc.modes import components as C
    from relax_hpc.rollout.engine import GenerateRequest, generate_all
    from relax_hpc.rollout.hf_engine import sampling_params

    torch.set_num_threads(threads)
    cfg = load_recipe(recipe, overrides)
    policy = C.build_policy(cfg, device_pref=cfg.rollout.device)
    engines = {d: C.build_engine(load_recipe(recipe, [*overrides, f"rollout.hf_decoder={d}"]), policy.tokenizer,
                                 seed=cfg.seed, model=policy.model, device=policy.device)
               for d in ("auto", "generate")}
    sampling = sampling_params(cfg.rollout.sampling, cfg.rollout.n_samples)
    stream = C.build_prompt_stream(cfg, policy.tokenizer)
    times: dict[str, list[float]] = {d: [] for d in engines}
    lengths: dict[str, list[float]] = {d: [] for d in engines}
    sync = torch.cuda.synchronize if policy.device.startswith("cuda") else (lambda: None)
    loop = asyncio.new_event_loop()
    for i in range(warmup + batches):
        batch = stream.next_batch(cfg.rollout.batch_prompts)
        for d, engine in engines.items():
            reqs = [GenerateRequest(f"{d}-{i}-{k}", p.prompt_ids, sampling, multimodal=p.multimodal)
                    for k, p in enumerate(batch)]
            sync()
            t0 = time.perf_counter()
            out = loop.run_until_complete(generate_all(engine, reqs))
            sync()
            if i >= warmup:
                times[d].append(time.perf_counter() - t0)
                lengths[d].append(statistics.mean(len(s.token_ids) for r in out for s in r.samples))
    for engine in engines.values():
        loop.run_until_complete(engine.close())
    loop.close()
    res: dict[str, Any] = {"benchmark": "generate", "recipe": str(recipe), "overrides": overrides,
                           "device": policy.device, "threads": threads, "batches": batches,
                           "batch": f"{cfg.rollout.batch_prompts} prompts x {cfg.rollout.n_samples} samples, "
                                    f"max_new_tokens {cfg.rollout.sampling.max_new_tokens}",
                           "loop_used": engines["auto"].uses_loop}
    for d, name in (("auto", "loop"), ("generate", "generate")):
        res[f"{name}_ms_median"] = 1000 * statistics.median(times[d])
        res[f"{name}_ms_min"] = 1000 * min(times[d])
        res[f"{name}_response_tokens_mean"] = statistics.mean(lengths[d])
    res["speedup"] = res["generate_ms_median"] / res["loop_ms_median"]
    res["machine"] = machine()
    return res


def measure_mix(recipe: Path, overrides: list[str], *, law: Any, decoders: list[str], batches: int, warmup: int,
                threads: int, vllm_opts: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every request of ``batches`` batches submitted at once to each decoder (``auto``, ``generate``: static
    batches on the policy's module; ``slots``: an engine with a slot pool), their budgets drawn from ``law``."""
    import torch

    from relax_hpc.bench.lengths import percentiles
    from relax_hpc.config.load import load_recipe
    from relax_hpc.modes import components as C
    from relax_hpc.rollout.hf_engine import sampling_params

    torch.set_num_threads(threads)
    cfg = load_recipe(recipe, [*overrides, f"rollout.sampling.max_new_tokens={law.cap}"])
    policy = C.build_policy(cfg, device_pref=cfg.rollout.device)
    stream = C.build_prompt_stream(cfg, policy.tokenizer)
    prompts = [stream.next_batch(cfg.rollout.batch_prompts) for _ in range(warmup + batches)]
    sampling = sampling_params(cfg.rollout.sampling, cfg.rollout.n_samples)
    sync = torch.cuda.synchronize if policy.device.startswith("cuda") else (lambda: None)
    res: dict[str, Any] = {"benchmark": "generate", "recipe": str(recipe), "overrides": overrides,
                           "device": policy.device, "threads": threads, "batches": batches, "lengths": law.describe(),
                           "batch": f"{cfg.rollout.batch_prompts} prompts x {cfg.rollout.n_samples} samples, "
                                    f"max_new_tokens at most {law.cap}", "decoders": decoders}
    for d in decoders:
        if d == "vllm":
            res.update(vllm_mix(cfg, prompts, sampling, law, warmup=warmup, opts=vllm_opts or {}))
            continue
        engine = mix_engine(cfg, d, policy, threads)
        loop = asyncio.new_event_loop()
        try:
            if warmup:
                loop.run_until_complete(_stream(engine, prompts[:warmup], sampling, law, "w"))
            engine.metrics()  # a new window: the timed requests only
            sync()
            t0 = time.perf_counter()
            out = loop.run_until_complete(_stream(engine, prompts[warmup:], sampling, law, "t"))
            sync()
            seconds = time.perf_counter() - t0
            occ = engine.metrics()
        finally:
            loop.run_until_complete(engine.close())
            loop.close()
        lengths = [len(s.token_ids) for r in out for s in r.samples]
        pct = percentiles(lengths)
        res.update({f"{d}_s": seconds, f"{d}_tokens_per_s": sum(lengths) / seconds,
                    f"{d}_decode_occupancy": occ.get("perf/decode_occupancy"),
                    f"{d}_decode_low_occupancy_s": occ.get("perf/decode_low_occupancy_time"),
                    f"{d}_response_tokens_mean": pct["mean"], f"{d}_response_length_p50": pct["p50"],
                    f"{d}_response_length_p99": pct["p99"], f"{d}_critical_path_tokens": pct["max"]})
    if "auto" in decoders and "slots" in decoders:
        res["slots_speedup"] = res["slots_tokens_per_s"] / res["auto_tokens_per_s"]
    if "vllm" in decoders:
        for d in ("auto", "slots"):
            if d in decoders:
                res[f"vllm_over_{d}"] = res["vllm_tokens_per_s"] / res[f"{d}_tokens_per_s"]
    res["machine"] = machine()
    return res


def vllm_mix(cfg: Any, prompts: list[list[Any]], sampling: Any, law: Any, *, warmup: int,
             opts: dict[str, Any]) -> dict[str, Any]:
    """The decoder ``vllm``: vLLM's ``LLM.generate`` on the same requests (prompt ids, n, sampling, the budget drawn
    for each request id), all of the timed batches in one call, as :func:`_stream` submits them."""
    import torch

    from relax_hpc.bench.lengths import percentiles
    from relax_hpc.errors import UserError

    try:
        import vllm
        from vllm.inputs import TokensPrompt
    except ImportError as exc:
        raise UserError(f"--decoders vllm: vllm is not importable here ({exc})") from None
    t_load = time.perf_counter()
    llm = vllm.LLM(model=str(cfg.model.path), dtype=cfg.model.dtype, seed=cfg.seed,
                   gpu_memory_utilization=opts.get("memory", 0.3), enforce_eager=opts.get("eager", False),
                   max_model_len=cfg.data.max_prompt_tokens + law.cap)
    load_s = time.perf_counter() - t_load

    def run(batches: list[list[Any]], tag: str) -> list[Any]:
        ids, params = [], []
        for i, batch in enumerate(batches):
            for k, p in enumerate(batch):
                extra = {"top_k": sampling.top_k} if sampling.top_k > 0 else {}
                params.append(vllm.SamplingParams(n=sampling.n, temperature=sampling.temperature,
                                                  top_p=sampling.top_p, max_tokens=law.length(f"{tag}{i}-{k}"),
                                                  **extra))
                ids.append(TokensPrompt(prompt_token_ids=list(p.prompt_ids)))
        return llm.generate(ids, params, use_tqdm=False)

    if warmup:
        run(prompts[:warmup], "w")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = run(prompts[warmup:], "t")
    seconds = time.perf_counter() - t0
    lengths = [len(c.token_ids) for r in out for c in r.outputs]
    pct = percentiles(lengths)
    res = {"vllm_version": vllm.__version__, "vllm_eager": bool(opts.get("eager", False)),
           "vllm_load_s": load_s, "vllm_s": seconds, "vllm_tokens_per_s": sum(lengths) / seconds,
           "vllm_response_tokens_mean": pct["mean"], "vllm_response_length_p50": pct["p50"],
           "vllm_response_length_p99": pct["p99"], "vllm_critical_path_tokens": pct["max"]}
    return res


def mix_engine(cfg: Any, decoder: str, policy: Any, threads: int) -> Any:
    """The engine of ``decoder`` on the policy's module."""
    from relax_hpc.config.load import validate_dict
    from relax_hpc.modes import components as C
    from relax_hpc.rollout.hf_engine import HFEngine

    r = cfg.rollout
    if decoder == "slots":
        engine = HFEngine(policy.model, policy.tokenizer, r.sampling, device=policy.device,
                          batch_prompts=r.batch_prompts, seed=cfg.seed, threads=threads,
                          decoder="compiled" if r.hf_decoder == "compiled" else "auto",
                          slots=r.batch_prompts * r.n_samples,
                          slot_length=cfg.data.max_prompt_tokens + r.sampling.max_new_tokens)
        if not engine.slots:
            engine.shutdown()
            from relax_hpc.errors import UserError

            raise UserError("--decoders slots: the slot pool does not apply to this model (a Llama-style decoder "
                            "is needed: relax_hpc/rollout/graph_decode.py)")
        return engine
    data = cfg.model_dump(mode="json")
    data["rollout"]["hf_decoder"] = decoder
    return C.build_engine(validate_dict(data), policy.tokenizer, seed=cfg.seed, model=policy.model,
                          device=policy.device)


async def _stream(engine: Any, batches: list[list[Any]], sampling: Any, law: Any, tag: str) -> list[Any]:
    """Every request of ``batches`` at once, each with its drawn ``max_new_tokens``."""
    from dataclasses import replace

    from relax_hpc.rollout.engine import GenerateRequest, generate_all

    reqs = []
    for i, batch in enumerate(batches):
        for k, p in enumerate(batch):
            rid = f"{tag}{i}-{k}"
            reqs.append(GenerateRequest(rid, p.prompt_ids, replace(sampling, max_new_tokens=law.length(rid)),
                                        multimodal=p.multimodal))
    return await generate_all(engine, reqs)


def shape_recipe(shape: str, cache: Path) -> Path:
    """A recipe file for ``--shape``: bench step's model folder and workload (16 x 8, 256 new tokens) on cuda."""
    import torch
    import yaml

    from relax_hpc.bench.step import model_folder, parse_args, recipe

    device = "cuda" if torch.cuda.is_available() else "cpu"
    folder = model_folder(shape, cache, device)
    # bench step's own defaults (16 x 8, 256 new tokens), so every field its recipe reads is set
    ns = parse_args(["--shape", shape, "--device", device, "--warmup-steps", "0", "--steps", "1"])
    path = cache / f"generate-{shape}.yaml"
    path.write_text(yaml.safe_dump(recipe(folder, ns)))
    return path


def main(argv: list[str] | None = None) -> int:

    p = argparse.ArgumentParser(prog="relax-hpc bench generate", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--recipe", default=str(DEMO_RECIPE), help="recipe (default: recipes/demo.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field (repeatable), e.g. rollout.device=cuda")
    p.add_argument("--batches", type=int, default=40, help="timed batches of each decoder")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches first")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (a rollout worker's default is 1)")
    p.add_argument("--shape", default=None, help="a Qwen3 shape of bench step (qwen3-0.6b, qwen3-4b ...): random "
                   "weights, the real Qwen vocabulary, arithmetic prompts, 256 new tokens, on cuda (replaces --recipe)")
    p.add_argument("--cache", default="~/.cache/relax-hpc/bench-step", help="model folders of --shape")
    p.add_argument("--lengths", default=None, metavar="MIX", help="a length mix (uniform = the recipe's "
                   "max_new_tokens, lognormal:mean=512,sigma=1.0,cap=4096, file:lengths.json): every request of the "
                   "timed batches at once, per-request max_new_tokens drawn from it")
    p.add_argument("--decoders", default="auto,slots", help="with --lengths: comma list of auto (static batches "
                   "of the loop), generate (transformers.generate), slots (the slot pool), vllm (vLLM's "
                   "LLM.generate, the peer; a GPU)")
    p.add_argument("--vllm-memory", type=float, default=0.3, help="decoder vllm: share of the GPU's memory it "
                   "takes (weights and KV cache)")
    p.add_argument("--vllm-eager", action="store_true", help="decoder vllm: no CUDA graphs, no torch.compile")
    a = p.parse_args(argv)
    if a.batches < 1 or a.warmup < 0 or a.threads < 1:
        p.error("--batches and --threads must be >= 1, --warmup >= 0")
    engine = next((o.split("=", 1)[1] for o in reversed(a.overrides) if o.startswith("rollout.engine=")), "hf")
    if engine in ("vllm", "sglang") and a.shape is None:  # a server engine: against the hf engine, same prompts
        from relax_hpc.bench.engines import main as engines_main

        return engines_main([*(["--json"] if a.json else []), "--recipe", a.recipe, "--batches", str(a.batches),
                             "--warmup", str(a.warmup), "--threads", str(a.threads),
                             *(x for o in a.overrides for x in ("--set", o))])
    if a.shape is not None:
        from relax_hpc.bench.step import SHAPES

        if a.shape not in SHAPES:
            p.error(f"--shape must be one of {', '.join(sorted(SHAPES))}")
        a.recipe = str(shape_recipe(a.shape, Path(a.cache).expanduser()))
    recipe = Path(a.recipe)
    if a.lengths is not None:
        return measure_and_print(recipe, lambda: _measure_mix(a, recipe), as_json=a.json)
    return measure_and_print(recipe, lambda: measure(recipe, a.overrides, batches=a.batches, warmup=a.warmup,
                                                     threads=a.threads), as_json=a.json)


def _measure_mix(a: argparse.Namespace, recipe: Path) -> dict[str, Any]:
    from relax_hpc.bench.lengths import parse_lengths
    from relax_hpc.config.load import load_recipe
    from relax_hpc.errors import UserError

    decoders = [d for d in a.decoders.split(",") if d]
    bad = [d for d in decoders if d not in ("auto", "generate", "slots", "vllm")]
    if bad or not decoders:
        raise UserError(f"--decoders {a.decoders!r}: expected a comma list of auto, generate, slots, vllm")
    import importlib.util

    if "vllm" in decoders and importlib.util.find_spec("vllm") is None:
        raise UserError("--decoders vllm: the vllm package is not importable here (a GPU machine with vLLM: "
                        "tools/gpu/README.md, carry)")
    if not 0 < a.vllm_memory < 1:
        raise UserError(f"--vllm-memory {a.vllm_memory}: give a share of the GPU's memory between 0 and 1")
    default = load_recipe(recipe, a.overrides).rollout.sampling.max_new_tokens
    law = parse_lengths(a.lengths, default)
    return measure_mix(recipe, a.overrides, law=law, decoders=decoders, batches=a.batches, warmup=a.warmup,
                       threads=a.threads, vllm_opts={"memory": a.vllm_memory, "eager": a.vllm_eager})


if __name__ == "__main__":
    raise SystemExit(main())
