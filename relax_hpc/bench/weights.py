"""``relax-hpc bench weights``: weight-update latency of a server engine per path and the generation pause it causes.

Starts the recipe's server engine (default: ``vllm`` with the tiny model of ``bench engines``), keeps it busy with a
steady stream of generation requests, and publishes a new snapshot per update. For each update it times

* ``pause``: the generation pause, from the pause until generation runs again = pause -> load -> resume (no token is
  generated in between; with ``partial_rollout`` the cut samples are resubmitted after it, in wait mode it also
  covers draining the requests in flight); files path: the server reads the snapshot folder; ``--distributed``: the
  fast path is tried once, and its failure or fallback is reported,

and the publish time beside it (the trainer's side). Prints medians over ``--updates`` updates per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from relax_hpc.bench.common import DEMO_RECIPE, machine, measure_and_print
from relax_hpc.bench.engines import DEFAULT_OVERRIDES, start_server_engine


async def _traffic(engine: Any, stop: asyncio.Event, prompts: list[list[int]], max_new: int) -> int:
    """Keep ``len(prompts)`` requests in flight until ``stop``; generated tokens."""
    from relax_hpc.rollout.engine import GenerateRequest, SamplingParams
    from relax_hpc.rollout.server.partial import generate_resumable

    count = 0

    async def worker(k: int) -> None:
        nonlocal count
        i = 0
        while not stop.is_set():
            req = GenerateRequest(request_id=f"t{k}-{i}", prompt_ids=prompts[k % len(prompts)],
                                  sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=i))
            res, _ = await generate_resumable(engine, req, max_resubmits=8)
            count += sum(len(s.token_ids) for s in res.samples)
            i += 1

    await asyncio.gather(*(worker(k) for k in range(len(prompts))))
    return count


async def _one_update(engine: Any, version: int, source: Any, partial: bool) -> float:
    from relax_hpc.rollout.server.partial import update_weights

    t0 = time.perf_counter()
    await update_weights(engine, version, source, partial_rollout=partial)
    return time.perf_counter() - t0


def _publish(rd: Any, engine: Any, version: int) -> tuple[Path, dict[str, Any], float]:
    import torch
    from transformers import AutoModelForCausalLM

    from relax_hpc.weights.publisher import SnapshotPublisher

    model = AutoModelForCausalLM.from_pretrained(engine.setup.model_dir, dtype=torch.float32)
    state = {k: (v + 0.01 * version).contiguous() for k, v in model.state_dict().items()}
    conf = json.loads((engine.setup.model_dir / "config.json").read_text())
    t0 = time.perf_counter()
    folder = SnapshotPublisher(rd, keep_last=3).publish(state, version, version, model_config=conf)
    return folder, state, time.perf_counter() - t0


async def _run(engine: Any, rd: Any, *, updates: int, concurrency: int, distributed: bool) -> dict[str, Any]:
    from relax_hpc.rollout.engine import SnapshotFolder
    from relax_hpc.rollout.server.base import DistributedSource, GroupInfo
    from relax_hpc.rollout.server.process import free_port

    prompts = [[1, 5 + k % 9, 6, 17] for k in range(concurrency)]
    stop = asyncio.Event()
    traffic = asyncio.ensure_future(_traffic(engine, stop, prompts, 64))
    out: dict[str, Any] = {}
    version = engine.version
    for mode, partial in (("partial_rollout", True), ("wait", False)):
        upd, pub = [], []
        for _ in range(updates):
            await asyncio.sleep(0.5)
            version += 1
            folder, state, pub_s = await asyncio.to_thread(_publish, rd, engine, version)
            u = await _one_update(engine, version, SnapshotFolder(folder, verify="size"), partial)
            upd.append(u)
            pub.append(pub_s)
        out[f"files_{mode}_pause_ms_median"] = 1000 * statistics.median(upd)
        out[f"files_{mode}_pause_ms_max"] = 1000 * max(upd)
        out["publish_ms_median"] = 1000 * statistics.median(pub)
    if distributed:
        version += 1
        folder, state, _ = await asyncio.to_thread(_publish, rd, engine, version)
        metas = [[(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state.items()]]
        src = DistributedSource(GroupInfo("127.0.0.1", free_port(), world_size=2, backend="gloo"), metas)
        before = engine.stats.fallbacks
        u = await _one_update(engine, version, src, True)
        out["distributed_pause_ms"] = 1000 * u
        out["distributed_fell_back_to_files"] = engine.stats.fallbacks > before
        out["server_restarts"] = engine.stats.server_restarts
    stop.set()
    out["tokens_during_run"] = await traffic
    out["preempted_requests"] = engine.stats.preempted
    return out


def measure(recipe: Path, overrides: list[str], *, updates: int, concurrency: int, distributed: bool
            ) -> dict[str, Any]:
    from relax_hpc.config.load import load_recipe
    from relax_hpc.models.load import load_tokenizer
    from relax_hpc.rundir import RunDir

    extra = ["rollout.server.weight_sync=distributed"] if distributed else []
    cfg = load_recipe(recipe, [*overrides, *extra])
    tok = load_tokenizer(cfg.model)
    with tempfile.TemporaryDirectory(prefix="relax-bench-weights-") as tmp:
        engine, runner, start_s = start_server_engine(cfg, Path(tmp), tok)
        try:
            res = runner.run(_run(engine, RunDir(Path(tmp) / "run"), updates=updates, concurrency=concurrency,
                                  distributed=distributed), timeout=3600)
        finally:
            runner.run(engine.close(), timeout=120)
            runner.close()
    return {"benchmark": "weights", "engine": cfg.rollout.engine, "overrides": overrides, "updates": updates,
            "concurrent_requests": concurrency, "server_start_s": round(start_s, 1), **res, "machine": machine()}


def main(argv: list[str] | None = None) -> int:

    p = argparse.ArgumentParser(prog="relax-hpc bench weights", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--recipe", default=str(DEMO_RECIPE), help="recipe (default: recipes/demo.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field (repeatable), after: " + " ".join(DEFAULT_OVERRIDES))
    p.add_argument("--updates", type=int, default=5, help="updates per mode")
    p.add_argument("--concurrency", type=int, default=8, help="requests kept in flight")
    p.add_argument("--distributed", action="store_true", help="also try the fast path once")
    a = p.parse_args(argv)
    if a.updates < 1 or a.concurrency < 1:
        p.error("--updates and --concurrency must be >= 1")
    recipe = Path(a.recipe)
    return measure_and_print(recipe, lambda: measure(recipe, [*DEFAULT_OVERRIDES, *a.overrides], updates=a.updates,
                                                     concurrency=a.concurrency, distributed=a.distributed),
                             as_json=a.json)


if __name__ == "__main__":
    raise SystemExit(main())
