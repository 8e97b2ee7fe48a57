"""The megatron backend with pipeline parallelism, as real processes on the CPU (gloo), for
tests/integration/test_megatron_pp.py.

``python megatron_pp_worker.py OUT LAYOUT`` under torchrun is one rank of the pipelined run; ``... OUT LAYOUT
--reference`` is one process at PP=1 that checks the pipelined run's files against its own run. Layouts:

- ``tied``: PP=2 (2 ranks), tied embeddings, megatron's distributed optimizer; also a ``dist_checkpointing`` round trip;
- ``untied``: PP=2, untied embeddings, torch's AdamW (``distributed_optimizer: false``), every layer recomputed in
  the backward pass (``model.gradient_checkpointing``; the reference too);
- ``tp2pp2``: TP=2 x PP=2 (4 ranks), tied embeddings, the distributed optimizer;
- ``dp2pp2``: PP=2 x DP=2 (4 ranks), tied embeddings, the distributed optimizer (each replica trains on its share of
  the groups).

The pipelined run (every rank writes ``OUT/rank<r>.json``; rank 0 also ``OUT/state_<name>.pt``, HF-named weights):
logits and per-token log-probs (and entropies) of a packed micro-batch against the HF model's; the HF-named export
before training equals the HF model's state dict; two GRPO steps on groups with stale samples (so the old log-probs
run forward-only through the pipeline), each over several micro-batches (so the 1F1B schedule interleaves), with the
project's checkpoint after the first; the weights every rank gets with ``state_on_every_rank``; with the distributed
optimizer the ``dist_checkpointing`` checkpoint of step 1 loaded back and step 2 trained again.

``MEGATRON_PP_DEVICE=cuda-shared``: every process on the one GPU, over gloo (CUDA tensors staged through the
host), torch's AdamW (the backend turns the distributed optimizer off there); the HF model and the torch backend
stay on the CPU.

The reference (``OUT/reference.json``): the same steps at PP=1 give the same metrics and weights; the pipelined run's
checkpoint of step 1 loads at PP=1 into the same weights and moments and trains step 2 into the pipelined run's."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from backend_conformance import make_cfg, make_items

from relax_hpc.algorithms.registry import get_algorithm
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
from relax_hpc.trainer.backend import make_backend
from relax_hpc.trainer.batch import pack

LAYOUTS = {"tied": (1, 2, True, True, False), "untied": (1, 2, False, False, True), "tp2pp2": (2, 2, True, True, False),
           "dp2pp2": (1, 2, True, True, False)}
"""layout -> (tp, pp, tied embeddings, megatron's distributed optimizer, recompute)."""

STEP_ITEMS = ({"n": 12, "seed": 10, "stale_every": 3}, {"n": 12, "seed": 11, "stale_every": 5})
"""The items of the two training steps (groups of 4; some stale)."""

SHARED_GPU = os.environ.get("MEGATRON_PP_DEVICE", "cpu") == "cuda-shared"
DEVICE = "cuda" if SHARED_GPU else "cpu"
if SHARED_GPU:
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 comparisons with the CPU-built HF model


def config(layout: str, *, pp: int | None = None, num_ranks: int = 1) -> Any:
    """The recipe of ``layout`` (at another ``pp`` for the reference)."""
    tp, lpp, tied, dist_opt, recompute = LAYOUTS[layout]
    mc = {"tp": tp if pp is None else 1, "pp": lpp if pp is None else pp,
          "distributed_optimizer": dist_opt and not SHARED_GPU}
    return make_cfg(trainer={"backend": "megatron", "num_ranks": num_ranks, "megatron": mc, "lr": 1e-4},
                    algorithm={"loss_agg": "token_mean"},
                    model={"path": "tiny", "tiny": {"tie_embeddings": tied}, "gradient_checkpointing": recompute})


def hf_model(cfg: Any, tok: Any) -> Any:
    return build_tiny_model(cfg.model.tiny, len(tok), seed=5, pad_token_id=tok.pad_token_id,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)


def backend(cfg: Any, tok: Any, hf: Any, *, rank: int = 0, world: int = 1) -> Any:
    return make_backend(cfg, rank=rank, world_size=world, device=DEVICE, dtype=torch.float32,
                        algorithm=get_algorithm("grpo"), tokenizer=tok, model=copy.deepcopy(hf))


def step(meg: Any, k: int) -> dict[str, float]:
    """Training step ``k`` (0 or 1) on this replica's share of its items (groups of 4 dealt round-robin, as the store
    consumer would); the metrics less the timings."""
    items = make_items(**STEP_ITEMS[k])
    metrics = meg.train_step([it for i, it in enumerate(items) if (i // 4) % meg.dp_size == meg.dp_rank])
    return {name: v for name, v in metrics.items() if not name.startswith("perf/")}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


# ---------------------------------------------------------------------------------------------------- pipelined run
def pipelined(out: Path, layout: str) -> None:
    import torch.distributed as dist

    from relax_hpc.trainer.megatron.pipeline import forward_logprobs

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tok = build_digits_tokenizer()
    cfg = config(layout, num_ranks=world)
    hf = hf_model(cfg, tok)
    meg = backend(cfg, tok, hf, rank=rank, world=world)
    torch_cfg = make_cfg(algorithm={"loss_agg": "token_mean"},
                         model={"path": "tiny", "tiny": {"tie_embeddings": LAYOUTS[layout][2]}})
    torch_ref = make_backend(torch_cfg, rank=0, world_size=1, device="cpu", dtype=torch.float32,
                             algorithm=get_algorithm("grpo"), tokenizer=tok, model=copy.deepcopy(hf))
    res: dict[str, Any] = {"stage": meg.stage.rank, "stages": meg.stage.size, "tp_size": meg.tp_size,
                           "dp_size": meg.dp_size, "dist_opt": meg.dist_opt}
    ids = torch.as_tensor([[1, 5, 9, 4, 17, 13, 6, 7], [2, 3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        res["logits"] = float((meg.logits(ids.to(DEVICE)).cpu() - hf(input_ids=ids).logits).abs().max())
    mbs = pack(make_items(12, seed=1), 40, device=DEVICE, rows=False)
    res["micro_batches"] = len(mbs)
    got = forward_logprobs(meg, mbs, with_entropy=True)
    if meg.stage.last:
        with torch.no_grad():
            want = [torch_ref.sequence_logprobs(torch_ref.model, mb, with_entropy=True)
                    for mb in pack(make_items(12, seed=1), 40, device="cpu", rows=False)]
        res["logprobs"] = max(float((g[0].cpu() - w[0]).abs().max()) for g, w in zip(got, want, strict=True))
        res["entropy"] = max(float((g[1].cpu() - w[1]).abs().max()) for g, w in zip(got, want, strict=True))
    else:
        res["none_before_last"] = all(g is None for g in got)
    before = meg.full_state_dict()
    if rank == 0:
        res["export_before"] = max_diff(before, {k: v for k, v in hf.state_dict().items()})
    res["metrics"] = [step(meg, 0)]
    _save_state(meg, out, "step1", rank)
    model_sd, optim_sd = meg.checkpoint_state()
    if rank == 0:
        from relax_hpc.rundir import RunDir
        from relax_hpc.trainer.checkpoint import save_checkpoint

        save_checkpoint(RunDir.create(out / "run"), meg.step, model_sd=model_sd, optim_sd=optim_sd,
                        state={"store_position": {"writers": {}}})
    if meg.dist_opt:
        meg.save_dist_checkpoint(out / "dist")
    res["metrics"].append(step(meg, 1))
    _save_state(meg, out, "step2", rank)
    if meg.dist_opt:
        res.update(_dist_round_trip(meg, out, rank))
    meg.state_on_every_rank = True
    full = meg.full_state_dict()
    res["every_rank_keys"] = len(full)
    res["every_rank_sum"] = float(sum(float(t.double().sum()) for t in full.values()))
    res["warmup_loss"] = warmup(meg, tok)
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def warmup(meg: Any, tok: Any) -> float:
    """The loss of two supervised warm-up steps (through the pipeline where there is one)."""
    from relax_hpc.modes.trainer_role import warmup_stream

    out = meg.sft_warmup(warmup_stream(meg.cfg, tok), tok, steps=2, lr=1e-3, batch_size=4, max_tokens=48)
    return out["warmup/loss"]


def _save_state(meg: Any, out: Path, name: str, rank: int) -> None:
    """The HF-named weights (rank 0 gets them) in ``OUT/state_<name>.pt``; the buckets hold the same tensors."""
    sd = meg.full_state_dict()
    buckets = [b for b in meg.state_buckets(1 << 12)]
    if rank == 0:
        flat = {k: v for b in buckets for k, v in b.items()}
        assert len(buckets) > 1 and max_diff(flat, sd) == 0.0
        torch.save(sd, out / f"state_{name}.pt")
    else:
        assert sd == {} and all(b == {} for b in buckets)


def _dist_round_trip(meg: Any, out: Path, rank: int) -> dict[str, float]:
    """Step 1's ``dist_checkpointing`` checkpoint loaded back: the weights of step 1, then step 2 trained again."""
    meg.load_dist_checkpoint(out / "dist")
    meg.step = 1
    sd = meg.full_state_dict()
    again = step(meg, 1)
    sd2 = meg.full_state_dict()
    res = {"dist_metrics": again}
    if rank == 0:
        res["dist_weights1"] = max_diff(sd, torch.load(out / "state_step1.pt"))
        res["dist_weights2"] = max_diff(sd2, torch.load(out / "state_step2.pt"))
    return res


# ---------------------------------------------------------------------------------------------------- reference
def reference(out: Path, layout: str) -> None:
    """PP=1 in this process: the same two steps, and the pipelined run's checkpoint resumed (module docstring)."""
    from relax_hpc.rundir import RunDir
    from relax_hpc.trainer.checkpoint import latest_checkpoint, load_checkpoint

    tok = build_digits_tokenizer()
    cfg = config(layout, pp=1)
    hf = hf_model(cfg, tok)
    res: dict[str, Any] = {}
    ref = backend(cfg, tok, hf)
    res["metrics"] = [step(ref, 0)]
    res["weights1"] = max_diff(ref.full_state_dict(), torch.load(out / "state_step1.pt"))
    res["metrics"].append(step(ref, 1))
    res["weights2"] = max_diff(ref.full_state_dict(), torch.load(out / "state_step2.pt"))
    other = build_tiny_model(cfg.model.tiny, len(tok), seed=4, pad_token_id=tok.pad_token_id)
    resumed = backend(cfg, tok, other)
    msd, osd, _ = load_checkpoint(latest_checkpoint(RunDir(out / "run")))
    resumed.load_checkpoint_state(msd, osd)
    resumed.step = 1
    res["resumed_weights1"] = max_diff(resumed.full_state_dict(), torch.load(out / "state_step1.pt"))
    back = resumed.checkpoint_state()[1]["state"]
    res["resumed_moments"] = max(float((back[k][f] - osd["state"][k][f]).abs().max())
                                 for k in back for f in ("exp_avg", "exp_avg_sq", "step"))
    res["resumed_metrics"] = step(resumed, 1)
    res["resumed_weights2"] = max_diff(resumed.full_state_dict(), torch.load(out / "state_step2.pt"))
    res["warmup_loss"] = warmup(resumed, tok)
    (out / "reference.json").write_text(json.dumps(res))


if __name__ == "__main__":
    if "--reference" in sys.argv:
        reference(Path(sys.argv[1]), sys.argv[2])
    else:
        pipelined(Path(sys.argv[1]), sys.argv[2])
