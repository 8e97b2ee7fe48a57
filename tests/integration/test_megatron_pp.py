"""The megatron backend with pipeline parallelism as real processes (torchrun, gloo on the CPU): PP=2 with tied and
untied embeddings (the latter with recompute), and TP=2 x PP=2 and PP=2 x DP=2 on four processes
(tests/helpers/megatron_pp_worker.py). Logits and per-token log-probs equal the HF model's; the HF-named export equals
the HF
model's weights; two GRPO steps over several micro-batches (1F1B interleaving, the old log-probs of stale samples
forward-only through the pipeline) give the metrics and weights of the same steps at PP=1, the same metrics on every
rank; the pipelined run's checkpoint of step 1 resumes at PP=1 (same weights and moments) and trains step 2 into the
pipelined run's weights; with the distributed optimizer its ``dist_checkpointing`` checkpoint round-trips at PP=2
bit for bit; the supervised warm-up runs through the pipeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install -e '.[megatron]'")

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-5

PER_REPLICA = ("train/num_micro_batches", "train/tokens", "train/padding_fraction")
"""Metrics counted per data-parallel replica (each replica packs its own share)."""


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


ON_ONE_GPU = pytest.param("tied", "cuda-shared", id="tied-cuda-shared",
                          marks=[pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="needs a GPU")])


def _env(device: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests" / "helpers"),
                                              os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "MEGATRON_PP_DEVICE": device}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, also on a GPU machine
    return env


def _run(tmp_path: Path, layout: str, ranks: int,
         device: str = "cpu") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The pipelined run on ``ranks`` processes, then the PP=1 reference process; their JSON results."""
    worker = str(REPO / "tests" / "helpers" / "megatron_pp_worker.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), worker, str(tmp_path), layout], cwd=REPO, env=_env(device),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ref = subprocess.run([sys.executable, worker, str(tmp_path), layout, "--reference"], cwd=REPO,
                         env=_env(device), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-4000:]
    ranks_out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    return ranks_out, json.loads((tmp_path / "reference.json").read_text())


def _close(got: dict[str, float], want: dict[str, float], *, skip: tuple[str, ...] = ()) -> None:
    assert got.keys() == want.keys()
    for name in got:
        if name not in skip:
            assert got[name] == pytest.approx(want[name], rel=TOL, abs=TOL), name


def _check(ranks: list[dict[str, Any]], ref: dict[str, Any], *, tp: int, dp: int, dist_opt: bool) -> None:
    pp = 2
    assert len(ranks) == tp * pp * dp
    for r, res in enumerate(ranks):
        assert (res["stages"], res["tp_size"], res["dp_size"], res["dist_opt"]) == (pp, tp, dp, dist_opt)
        assert res["stage"] == r // (tp * dp)  # megatron's rank order: TP fastest, then DP, then PP
        assert res["micro_batches"] >= 3  # the 1F1B schedule interleaves
        assert res["logits"] < TOL
        if res["stage"] == pp - 1:
            assert res["logprobs"] < TOL and res["entropy"] < TOL
        else:
            assert res["none_before_last"]
        assert res["metrics"] == ranks[r % (tp * dp)]["metrics"]  # every stage of a replica: the last stage's
        for got, want in zip(res["metrics"], ranks[0]["metrics"], strict=True):  # every replica
            _close(got, want, skip=PER_REPLICA)
        assert res["every_rank_keys"] == 25 and res["every_rank_sum"] == ranks[0]["every_rank_sum"]
        assert res["warmup_loss"] == pytest.approx(ref["warmup_loss"], rel=TOL)
    head = ranks[0]
    assert head["export_before"] == 0.0  # the HF model's weights, every name, bit for bit
    skip = PER_REPLICA if dp > 1 else ()
    for got, want in zip(head["metrics"], ref["metrics"], strict=True):  # the same steps at PP=1
        _close(got, want, skip=skip)
    assert ref["weights1"] < TOL and ref["weights2"] < TOL
    assert ref["resumed_weights1"] == 0.0 and ref["resumed_moments"] == 0.0  # PP=2's checkpoint at PP=1
    _close(ref["resumed_metrics"], head["metrics"][1], skip=skip)
    assert ref["resumed_weights2"] < TOL
    if dist_opt:
        assert head["dist_weights1"] == 0.0 and head["dist_weights2"] == 0.0
        for res in ranks:
            assert res["dist_metrics"] == res["metrics"][1]


@pytest.mark.parametrize(("layout", "device"), [("tied", "cpu"), ("untied", "cpu"), ON_ONE_GPU])
def test_two_stages_match_hf_and_one_stage(tmp_path: Path, layout: str, device: str) -> None:
    """PP=2 on two processes: ``tied`` with megatron's distributed optimizer (and its dist_checkpointing round
    trip), ``untied`` with torch's AdamW and every layer recomputed in the backward pass; ``cuda-shared``: both
    processes on the one GPU over gloo (torch's AdamW: the backend turns the distributed optimizer off there)."""
    ranks, ref = _run(tmp_path, layout, 2, device)
    _check(ranks, ref, tp=1, dp=1, dist_opt=layout == "tied" and device == "cpu")


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "tp", "dp"), [("tp2pp2", 2, 1), ("dp2pp2", 1, 2)])
def test_four_ranks_with_two_stages(tmp_path: Path, layout: str, tp: int, dp: int) -> None:
    """TP=2 x PP=2 and PP=2 x DP=2 on four processes, tied embeddings, the distributed optimizer."""
    ranks, ref = _run(tmp_path, layout, 4)
    _check(ranks, ref, tp=tp, dp=dp, dist_opt=True)
