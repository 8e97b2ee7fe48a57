"""``relax-hpc bench generate``: the ``hf`` engine's sampling loop against ``transformers.generate``, same model.

Builds the recipe's policy (default: the demo's tiny model), then times ``engine.generate`` on the same prompt
batches (``rollout.batch_prompts`` prompts x ``rollout.n_samples`` samples, the recipe's sampling settings) with
``rollout.hf_decoder: auto`` (the loop) and ``generate``, alternating batch by batch so that both see the same
machine. Prints the median and minimum ms per batch of each and ``speedup`` = generate median / loop median, with
the mean response length of each (the two sample from the same distribution, so these should agree).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from relax_hpc.bench.common import DEMO_RECIPE, machine, print_fields


def measure(recipe: Path, overrides: list[str], *, batches: int, warmup: int, threads: int) -> dict[str, Any]:
    import torch

    from relax_hpc.config.load import load_recipe
    from relax_hpc.modes import components as C

    torch.set_num_threads(threads)
    cfg = load_recipe(recipe, overrides)
    policy = C.build_policy(cfg, device_pref=cfg.rollout.device)
    engines = {d: C.build_engine(load_recipe(recipe, [*overrides, f"rollout.hf_decoder={d}"]), policy)
               for d in ("auto", "generate")}
    stream = C.build_prompt_stream(cfg, policy.tokenizer)
    times: dict[str, list[float]] = {d: [] for d in engines}
    lengths: dict[str, list[float]] = {d: [] for d in engines}
    sync = torch.cuda.synchronize if policy.device.startswith("cuda") else (lambda: None)
    for i in range(warmup + batches):
        batch = stream.next_batch(cfg.rollout.batch_prompts)
        for d, engine in engines.items():
            sync()
            t0 = time.perf_counter()
            out = engine.generate([p.prompt_ids for p in batch], cfg.rollout.n_samples,
                                  multimodal=[p.multimodal for p in batch])
            sync()
            if i >= warmup:
                times[d].append(time.perf_counter() - t0)
                lengths[d].append(statistics.mean(len(c.token_ids) for g in out for c in g))
    res: dict[str, Any] = {"benchmark": "generate", "recipe": str(recipe), "overrides": overrides,
                           "device": policy.device, "threads": threads, "batches": batches,
                           "batch": f"{cfg.rollout.batch_prompts} prompts x {cfg.rollout.n_samples} samples, "
                                    f"max_new_tokens {cfg.rollout.sampling.max_new_tokens}",
                           "loop_used": bool(engines["auto"]._loop)}
    for d, name in (("auto", "loop"), ("generate", "generate")):
        res[f"{name}_ms_median"] = 1000 * statistics.median(times[d])
        res[f"{name}_ms_min"] = 1000 * min(times[d])
        res[f"{name}_response_tokens_mean"] = statistics.mean(lengths[d])
    res["speedup"] = res["generate_ms_median"] / res["loop_ms_median"]
    res["machine"] = machine()
    return res


def main(argv: list[str] | None = None) -> int:
    from relax_hpc.errors import ConfigError, UserError

    p = argparse.ArgumentParser(prog="relax-hpc bench generate", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--recipe", default=str(DEMO_RECIPE), help="recipe (default: recipes/demo.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field (repeatable), e.g. rollout.device=cuda")
    p.add_argument("--batches", type=int, default=40, help="timed batches of each decoder")
    p.add_argument("--warmup", type=int, default=3, help="untimed batches first")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (a rollout worker's default is 1)")
    a = p.parse_args(argv)
    if a.batches < 1 or a.warmup < 0 or a.threads < 1:
        p.error("--batches and --threads must be >= 1, --warmup >= 0")
    recipe = Path(a.recipe)
    if not recipe.is_file():
        print(f"error: recipe {recipe} not found (give --recipe)", file=sys.stderr)
        return 2
    try:
        res = measure(recipe, a.overrides, batches=a.batches, warmup=a.warmup, threads=a.threads)
    except (ConfigError, UserError) as exc:
        for line in getattr(exc, "problems", None) or [str(exc)]:
            print(f"error: {line}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print_fields(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
