"""The megatron backend as two real processes (torchrun, gloo on the CPU), at TP=2 (tied and untied embeddings) and
at TP=1 x DP=2 (megatron's distributed optimizer, and torch's AdamW): logits and per-token log-probs equal the HF
model's, GRPO-loss gradients and step losses equal the torch backend's on the whole batch
(tests/helpers/megatron_tp_worker.py); the two-rank checkpoints (the project's, and megatron's dist_checkpointing one)
load into one TP=1 x DP=1 rank bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install -e '.[megatron]'")

REPO = Path(__file__).resolve().parents[2]


def _pythonpath() -> str:
    """The repository and tests/helpers/ first, then whatever the caller's PYTHONPATH had."""
    return os.pathsep.join(p for p in (str(REPO), str(REPO / "tests" / "helpers"),
                                              os.environ.get("PYTHONPATH", "")) if p)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


ON_ONE_GPU = pytest.param("cuda-shared", marks=[pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a GPU")])


@pytest.mark.parametrize("device", ["cpu", ON_ONE_GPU])
@pytest.mark.parametrize("layout", ["tied", "untied", "dp2", "dp2-adamw"])
def test_two_ranks_match_hf_and_the_torch_backend(tmp_path: Path, layout: str, device: str) -> None:
    """``cuda-shared``: the two ranks share the one GPU over gloo (TP layouts only: two data-parallel replicas
    need megatron DDP's coalesced all-reduce of CUDA gradient buffers, which gloo lacks; DP on GPUs is NCCL), and
    the backend turns megatron's distributed optimizer off there (it crashed the ranks over gloo with CUDA tensors):
    torch's AdamW, no dist_checkpointing."""
    if device == "cuda-shared" and layout.startswith("dp2"):
        pytest.skip("two replicas on one GPU over gloo: gloo has no coalesced all-reduce of CUDA tensors")
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "MEGATRON_TP_DEVICE": device}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "tests" / "helpers" / "megatron_tp_worker.py"), str(tmp_path), layout],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(ranks):
        assert r["dist_opt"] == float(layout != "dp2-adamw" and device != "cuda-shared")
        if layout.startswith("dp2"):  # two replicas: each reads its own groups
            assert (r["tp_size"], r["dp_size"], r["dp_rank"]) == (1, 2, rank)
        else:  # one replica: both TP ranks read the same groups
            assert (r["tp_size"], r["dp_size"], r["dp_rank"]) == (2, 1, 0)
        assert r["logits"] < 1e-5
        assert r["logprobs"] < 1e-5 and r["entropy"] < 1e-5
        assert r["grads"] < 1e-5  # relative to the largest gradient element
        first, *later = zip(r["loss_megatron"], r["loss_torch"], strict=True)
        assert first[0] == pytest.approx(first[1], rel=1e-5, abs=1e-7)  # the same weights: the same loss
        for got, want in later:  # after AdamW steps (elements with gradients near eps may move a little apart)
            assert got == pytest.approx(want, rel=1e-4, abs=2e-6)
        norms = list(zip(r["norm_megatron"], r["norm_torch"], strict=True))  # every shard counted once over TP
        assert norms[0][0] == pytest.approx(norms[0][1], rel=1e-5)
        for got, want in norms[1:]:
            assert got == pytest.approx(want, rel=1e-3)
    assert ranks[0]["loss_megatron"] == ranks[1]["loss_megatron"]
    assert ranks[0]["hf_keys_equal"] == 1.0
    _resumes_at_tp1(tmp_path / "run", layout)
    n = ranks[0]["full_keys"]
    assert n > 0 and ranks[1]["full_keys"] == n  # state_on_every_rank (colocate): every rank gets the whole model
    assert (ranks[0]["full_keys_rank0_only"], ranks[1]["full_keys_rank0_only"]) == (n, 0)  # else rank 0 only
    assert ranks[0]["weights_after"] < 1e-4  # three AdamW steps (lr 1e-3) on the same gradients


def _resumes_at_tp1(run: Path, layout: str) -> None:
    """The two-rank run's checkpoint (HF-named model and AdamW moments) loads into a one-rank TP=1 backend (in a
    fresh process): its weights and moments are the checkpoint's, bit for bit, and it trains on. The distributed
    optimizer's dist_checkpointing checkpoint of the same step (DP=2, or TP=2) loads at DP=1 (TP=1 x DP=1 only from
    DP=2: dp_reshardable changes the data-parallel size, not the TP size), bit for bit too."""
    code = f"""
import torch
from tests.helpers.backend_conformance import make_cfg, make_items
from relax_hpc.algorithms.registry import get_algorithm
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
from relax_hpc.rundir import RunDir
from relax_hpc.trainer.backend import make_backend
from relax_hpc.trainer.checkpoint import latest_checkpoint, load_checkpoint
tok = build_digits_tokenizer()
tiny = {{"tie_embeddings": {layout != "untied"}}}
# on a GPU machine this CPU process runs the GPU's megatron-core, whose DDP gradient sync (the distributed
# optimizer's) asks for a CUDA stream: AdamW there; the checkpoint moves between the two optimizers
# (test_megatron_optim.py), and the dist_checkpointing case (dp2) never runs on a GPU machine
dist = {layout == "dp2" or not _cuda()}
cfg = make_cfg(trainer={{"backend": "megatron", "megatron": {{"distributed_optimizer": dist}}}},
               model={{"path": "tiny", "tiny": tiny}})
hf = build_tiny_model(cfg.model.tiny, len(tok), seed=9, pad_token_id=tok.pad_token_id)
b = make_backend(cfg, rank=0, world_size=1, device="cpu", dtype=torch.float32, algorithm=get_algorithm("grpo"),
                 tokenizer=tok, model=hf)
msd, osd, _ = load_checkpoint(latest_checkpoint(RunDir({str(run)!r})))
b.load_checkpoint_state(msd, osd)
sd = b.full_state_dict()
assert sd.keys() == msd.keys() and all(torch.equal(sd[k], msd[k]) for k in sd)
back = b.checkpoint_state()[1]["state"]
assert back.keys() == osd["state"].keys()
assert all(torch.equal(back[k][f], osd["state"][k][f]) for k in back for f in ("exp_avg", "exp_avg_sq", "step"))
m = b.train_step(make_items(8, seed=3))
assert m["train/loss"] == m["train/loss"] and b.step == 1
if {layout == "dp2"}:
    c = make_backend(cfg, rank=0, world_size=1, device="cpu", dtype=torch.float32, algorithm=get_algorithm("grpo"),
                     tokenizer=tok, model=build_tiny_model(cfg.model.tiny, len(tok), seed=4,
                                                           pad_token_id=tok.pad_token_id))
    c.load_dist_checkpoint({str(run.parent / "dist")!r})
    sd = c.full_state_dict()
    assert sd.keys() == msd.keys() and all(torch.equal(sd[k], msd[k]) for k in sd)
    back = c.checkpoint_state()[1]["state"]
    assert all(torch.equal(back[k][f], osd["state"][k][f]) for k in back for f in ("exp_avg", "exp_avg_sq", "step"))
    print("dist resumed")
print("resumed")
"""
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "PYTHONWARNINGS": "ignore",
           "CUDA_VISIBLE_DEVICES": ""}  # on the CPU, also on a GPU machine (megatron-core places RoPE on CUDA)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "resumed" in proc.stdout, proc.stderr[-3000:]
    assert ("dist resumed" in proc.stdout) == (layout == "dp2")
