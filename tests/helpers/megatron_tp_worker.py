"""One rank of the two-process megatron checks (run by tests/integration/test_megatron_tp.py under torchrun), by
``MEGATRON_TP_DEVICE``: ``cpu`` (default) gloo on the CPU; ``cuda-shared`` both ranks on the one GPU 0, gloo (the
one-GPU check of the issue: NCCL refuses two ranks on one device); ``cuda`` NCCL, one GPU per rank, as
tools/gpu/x2.sh runs it.

Layouts: ``tied`` / ``untied`` = TP=2 (one replica), ``dp2`` = TP=1 x DP=2 (each rank trains on its share of the
groups, as the store consumer would hand them out), all with megatron's distributed optimizer (but ``cuda-shared``,
where the backend turns it off: gloo with CUDA tensors); ``dp2-adamw`` = DP=2
with ``distributed_optimizer: false`` (torch's AdamW, replicated state). With the distributed optimizer the run also
saves a ``dist_checkpointing`` checkpoint (``OUT/dist``) at the same step as the project's checkpoint.

Every rank builds the megatron backend from the same tiny HF model and, in the same process, the torch backend (one
rank, all groups) from a copy of it, then writes what it measured to ``OUT/rank<r>.json``: the largest differences of
the full logits and of the per-token log-probs of a packed micro-batch against the HF model, of this rank's GRPO-loss
gradient shard (after the DP/TP reductions) against the torch backend's gradient sharded by the weight mapping, and
the two backends' step losses over a few steps."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from backend_conformance import make_cfg, make_items

from relax_hpc.algorithms.registry import get_algorithm
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
from relax_hpc.trainer.backend import make_backend
from relax_hpc.trainer.batch import pack
from relax_hpc.trainer.megatron.mapping import hf_to_megatron


def mine(items: list, dp_rank: int, dp_size: int) -> list:
    """This replica's groups (groups of 4 items, dealt round-robin)."""
    return [it for i, it in enumerate(items) if (i // 4) % dp_size == dp_rank]


def main(out: Path, layout: str) -> None:
    mode = os.environ.get("MEGATRON_TP_DEVICE", "cpu")
    dev = "cpu" if mode == "cpu" else "cuda"
    if mode == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    elif mode == "cuda-shared":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 comparisons with the CPU-built HF model
    dist.init_process_group("nccl" if mode == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tok = build_digits_tokenizer()
    tp = 1 if layout.startswith("dp2") else 2
    tied = layout != "untied"
    common = {"algorithm": {"loss_agg": "token_mean"}, "model": {"path": "tiny", "tiny": {"tie_embeddings": tied}}}
    mc = {"tp": tp, "distributed_optimizer": layout != "dp2-adamw"}
    mcfg = make_cfg(trainer={"backend": "megatron", "num_ranks": world, "megatron": mc}, **common)
    tcfg = make_cfg(**common)
    hf = build_tiny_model(tcfg.model.tiny, len(tok), seed=5, pad_token_id=tok.pad_token_id,
                          bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    algo = get_algorithm("grpo")
    meg = make_backend(mcfg, rank=rank, world_size=world, device=dev, dtype=torch.float32, algorithm=algo,
                       tokenizer=tok, model=copy.deepcopy(hf))
    ref = make_backend(tcfg, rank=0, world_size=1, device=dev, dtype=torch.float32, algorithm=algo, tokenizer=tok,
                       model=copy.deepcopy(hf).to(dev))
    res: dict[str, float | list[float]] = {"tp_size": meg.tp_size, "dp_size": meg.dp_size, "dp_rank": meg.dp_rank,
                                           "dist_opt": float(meg.dist_opt)}
    ids = torch.as_tensor([[1, 5, 9, 4, 17, 13, 6, 7], [2, 3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        res["logits"] = float((meg.logits(ids.to(dev)).cpu() - hf(input_ids=ids).logits).abs().max())
        mb = pack(make_items(12, seed=1), 200, device=dev, rows=False)[0]
        lp_meg, ent_meg = meg.sequence_logprobs(meg.model, mb, with_entropy=True)
        lp_hf, ent_hf = ref.sequence_logprobs(ref.model, mb, with_entropy=True)
        res["logprobs"] = float((lp_meg - lp_hf).abs().max())
        res["entropy"] = float((ent_meg - ent_hf).abs().max())
    items = make_items(12, seed=2)
    res["grads"] = _grad_difference(meg, ref, mine(items, meg.dp_rank, meg.dp_size), items)
    for key in ("loss_megatron", "loss_torch", "norm_megatron", "norm_torch"):
        res[key] = []
    for step in range(3):
        items = make_items(12, seed=10 + step)
        got = meg.train_step(mine(copy.deepcopy(items), meg.dp_rank, meg.dp_size))
        want = ref.train_step(copy.deepcopy(items))
        res["loss_megatron"].append(got["train/loss"])
        res["loss_torch"].append(want["train/loss"])
        res["norm_megatron"].append(got["train/grad_norm"])
        res["norm_torch"].append(want["train/grad_norm"])
    model_sd, optim_sd = meg.checkpoint_state()  # every rank calls (TP all-gathers); rank 0 saves
    if rank == 0:
        from relax_hpc.rundir import RunDir
        from relax_hpc.trainer.checkpoint import save_checkpoint

        save_checkpoint(RunDir.create(out / "run"), meg.step, model_sd=model_sd, optim_sd=optim_sd,
                        state={"store_position": {"writers": {}}})
    if meg.dist_opt:
        meg.save_dist_checkpoint(out / "dist")  # every rank writes its shards
    res["full_keys_rank0_only"] = len(meg.full_state_dict())  # publishing: only rank 0 gets the tensors
    meg.state_on_every_rank = True  # what colocate sets: every rank's engine needs the whole model
    full = meg.full_state_dict()
    res["full_keys"] = len(full)
    if rank == 0:
        want = ref.full_state_dict()
        res["weights_after"] = max(float((full[k].cpu() - want[k].cpu()).abs().max()) for k in full)
        res["hf_keys_equal"] = float(full.keys() == want.keys())  # lm_head.weight too when tied, as HF's
    (out / f"rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def _grad_difference(meg: object, ref: object, share: list, items: list) -> float:
    """The largest difference (relative to the largest element) of this rank's megatron gradient shard on its
    ``share`` of ``items`` (after the DP/TP reductions) from the torch backend's gradient on all ``items``, sharded
    by the weight mapping. With the distributed optimizer, the gradients are reduce-scattered: only this rank's
    ranges of each parameter hold the sum, and only those are compared."""
    meg.begin_step()
    meg.accumulate(copy.deepcopy(share))
    meg._finalize_grads()
    ref.begin_step()
    ref.accumulate(copy.deepcopy(items))
    grads = {n: p.grad for n, p in ref.model.named_parameters()}
    mc = meg.cfg.trainer.megatron
    want = hf_to_megatron(grads, meg.shape, tp=mc.tp, tp_rank=meg.tp_rank, vocab_multiple=mc.vocab_multiple)
    assert want.keys() == meg.params.keys(), (sorted(want), sorted(meg.params))
    owned = {n: slice(None) for n in want}
    if meg.dist_opt:
        from relax_hpc.trainer.megatron.optim import _ranges

        ranges = {id(p): r for _, p, r in _ranges(meg.optimizer, list(meg.params.values()))}
        owned = {n: slice(0, 0) if ranges[id(p)] is None else slice(ranges[id(p)].start, ranges[id(p)].end)
                 for n, p in meg.params.items()}
    assert sum(len(range(meg.params[n].numel())[owned[n]]) for n in want) > 0
    diff = max(float((meg.params[n].main_grad.view(-1)[owned[n]] - g.reshape(-1)[owned[n]]).abs().max())
               if owned[n] != slice(0, 0) else 0.0 for n, g in want.items())
    scale = max(float(g.abs().max()) for g in want.values())
    meg.begin_step()
    ref.begin_step()
    return diff / scale


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
