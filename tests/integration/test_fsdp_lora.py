"""FSDP2 with ``model.lora`` over 2 real ranks (gloo on CPU): only the adapters train (the gathered base weights are
the initial ones), the hand-over state and its buckets are the adapter alone under PEFT's names, and one update on
half the batch per rank equals the single-process update on the whole batch; the checkpoint holds the adapter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from relax_hpc.algorithms.registry import get_algorithm
from relax_hpc.config.load import validate_dict
from relax_hpc.models.tiny import build_tiny_model
from relax_hpc.rundir import RunDir
from relax_hpc.trainer.torch_trainer import TorchTrainer
from tests.helpers.fsdp_case import CFG, items

LORA_CFG = {**CFG, "model": {**CFG["model"], "lora": {"rank": 4, "alpha": 8.0}}}

RANK = textwrap.dedent("""
    import sys, json, torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from tests.helpers.fsdp_case import items
    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.config.load import validate_dict
    from relax_hpc.models.tiny import build_tiny_model
    from relax_hpc.modes.dist import init_trainer_group
    from relax_hpc.rundir import RunDir
    from relax_hpc.trainer.torch_trainer import TorchTrainer
    torch.set_num_threads(1)
    rd, rank = RunDir(sys.argv[1]), int(sys.argv[2])
    init_trainer_group(rd, rank, 2, "cpu", timeout_s=120)
    cfg = validate_dict(json.loads(sys.argv[3]))
    model = build_tiny_model(cfg.model.tiny, 18, seed=0)
    torch.manual_seed(0)  # the adapters' lora_A init, as the single process below
    tr = TorchTrainer(cfg, model, device="cpu", dtype=torch.float32, algorithm=get_algorithm("grpo"), world_size=2,
                      rank=rank)
    trained = sorted(n for n, p in tr.model.named_parameters() if p.requires_grad)
    m = tr.train_step(items()[rank::2])
    sd = tr.full_state_dict()
    buckets = list(tr.state_buckets(2000))
    whole = get_model_state_dict(tr.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    model_sd, _ = tr.checkpoint_state()
    if rank == 0:
        merged = {k: v for b in buckets for k, v in b.items()}
        assert merged.keys() == sd.keys() and all(torch.equal(merged[k], sd[k]) for k in sd)
        save_file({k: v.contiguous() for k, v in sd.items()}, sys.argv[1] + "/adapter.st")
        save_file({k: v.contiguous() for k, v in whole.items() if "lora_" not in k}, sys.argv[1] + "/base.st")
        print(json.dumps({"loss": m["train/loss"], "grad_norm": m["train/grad_norm"], "trained": trained,
                          "checkpoint": sorted(model_sd)}))
    sys.stdout.flush()
    import os
    os._exit(0)  # as `relax-hpc role` does: gloo's threads may abort the interpreter's teardown
""")


@pytest.mark.integration
def test_fsdp2_lora_trains_only_the_adapter_and_hands_over_the_adapter(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from relax_hpc.models.lora import adapter_state

    rd = RunDir.create(tmp_path / "run")
    repo = str(Path(__file__).resolve().parents[2])
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": repo}
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rd.root), str(r), json.dumps(LORA_CFG)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in sorted(zip(procs, outs), key=lambda po: po[0].returncode == 0):  # a crashed rank first
        assert p.returncode == 0, err[-3000:]
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    assert got["trained"] and all(".lora_A." in n or ".lora_B." in n for n in got["trained"]), got["trained"]
    assert got["checkpoint"] and all("lora_" in k for k in got["checkpoint"])
    # the single-process run on the whole batch
    cfg = validate_dict({**LORA_CFG, "trainer": {**LORA_CFG["trainer"], "num_ranks": 1}})
    model = build_tiny_model(cfg.model.tiny, 18, seed=0)
    torch.manual_seed(0)
    tr = TorchTrainer(cfg, model, device="cpu", dtype=torch.float32, algorithm=get_algorithm("grpo"))
    m1 = tr.train_step(items())
    assert abs(got["loss"] - m1["train/loss"]) <= 1e-5 * max(1.0, abs(m1["train/loss"]))
    assert abs(got["grad_norm"] - m1["train/grad_norm"]) <= 1e-4 * m1["train/grad_norm"]
    sharded, single = load_file(str(rd.root / "adapter.st")), adapter_state(tr.model)
    assert sharded.keys() == single.keys() and all(k.startswith("base_model.model.") for k in sharded)
    for k, v in sharded.items():
        torch.testing.assert_close(v, single[k], atol=3e-4, rtol=1e-3)
    assert any(v.abs().max() > 0 for k, v in sharded.items() if "lora_B" in k)  # the adapter moved
    base = {f"base_model.model.{k}": v for k, v in build_tiny_model(cfg.model.tiny, 18, seed=0).state_dict().items()}
    frozen = load_file(str(rd.root / "base.st"))
    assert frozen
    for k, v in frozen.items():  # PEFT's names: base_layer.weight for an adapted layer
        assert torch.equal(v, base[k.replace(".base_layer.", ".")]), k
