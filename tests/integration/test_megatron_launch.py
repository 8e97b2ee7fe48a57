"""Launching the megatron backend: the Qwen3-4B TP=2 recipe validates and renders its torchrun sbatch script; bad
torchrun layouts are one error; ``relax_hpc.launch.torchrun`` runs a TP=2 colocate run as two real ranks, and a
SIGUSR2 to it (Slurm's time-limit warning) checkpoints the ranks and exits 3 (requeue), after which the run resumes
and completes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from relax_hpc.config.load import load_recipe
from relax_hpc.errors import ConfigError, UserError
from relax_hpc.launch.sbatch import render_run
from relax_hpc.launch.torchrun import exit_status, launcher_args
from relax_hpc.rundir import RunDir
from tests.helpers.runutil import DEMO, REPO, cli, events, metrics, torchrun_colocate, torchrun_colocate_preempted

RECIPE = REPO / "recipes" / "qwen3-4b-megatron-tp2.yaml"


def test_the_tp2_recipe_validates_and_renders_a_torchrun_step(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    cfg = load_recipe(RECIPE)
    assert cfg.trainer.backend == "megatron" and cfg.trainer.megatron.tp == 2 and cfg.trainer.num_ranks == 8
    assert cfg.launch.trainer.launcher == "torchrun"
    (script,) = render_run(RunDir(tmp_path / "run"), cfg)
    text = script.text
    trainer, rollout = text.split("#SBATCH hetjob")
    assert "#SBATCH --ntasks=1\n" in trainer and "#SBATCH --cpus-per-task=96\n" in trainer  # 8 ranks x 12 CPUs
    assert "#SBATCH --gpus-per-node=8\n" in trainer and "#SBATCH --ntasks-per-node" not in trainer
    assert "#SBATCH --ntasks=8\n" in rollout  # the rollout workers stay one task each
    line = next(x for x in text.splitlines() if "relax_hpc.launch.torchrun" in x and "exec srun" in x)
    for part in ("--het-group=0", "--ntasks-per-node=1", "--nnodes=1", "--nproc-per-node=8", "--rdzv-backend=c10d",
                 '--rdzv-endpoint="$head:29500"', "--shutdown-timeout=300", "-m relax_hpc role trainer"):
        assert part in line, part
    assert 'SLURM_JOB_NODELIST_HET_GROUP_0' in text
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


QWEN3_32B = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 5120,
             "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
             "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False, "rope_theta": 1000000,
             "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
"""Qwen3-32B's config.json (the shape fields the megatron mapping checks)."""


def test_the_32b_tp4_pp4_recipe_validates_against_its_config_and_renders_four_torchrun_nodes(tmp_path: Path) -> None:
    """recipes/qwen3-32b-megatron-tp4-pp4.yaml: `relax-hpc validate` with a local model folder checks TP 4 x PP 4
    against the model's heads and 64 layers (and refuses a PP that does not divide them, in one line); the sbatch
    script starts 8 ranks on each of the 4 trainer nodes under torchrun, rollout one task per node."""
    pytest.importorskip("megatron.core")
    recipe = REPO / "recipes" / "qwen3-32b-megatron-tp4-pp4.yaml"
    model = tmp_path / "Qwen3-32B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_32B))
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    hub = "model.tokenizer=Qwen/Qwen3-32B"  # a hub name not in the cache: preflight leaves it to the nodes
    sets = ["--set", f"model.path={model}", "--set", f"data.path={data}", "--set", hub]
    cfg = load_recipe(recipe, [s for s in sets if s != "--set"])
    mc = cfg.trainer.megatron
    assert (mc.tp, mc.pp, cfg.trainer.num_ranks, mc.checkpoint_format) == (4, 4, 32, "dist")
    (script,) = render_run(RunDir(tmp_path / "run"), cfg)
    trainer, rollout = script.text.split("#SBATCH hetjob")
    assert "#SBATCH --nodes=4\n" in trainer and "#SBATCH --ntasks=4\n" in trainer
    assert "#SBATCH --nodes=4\n" in rollout and "#SBATCH --ntasks=4\n" in rollout
    line = next(x for x in script.text.splitlines() if "relax_hpc.launch.torchrun" in x and "exec srun" in x)
    assert "--nnodes=4" in line and "--nproc-per-node=8" in line and "--ntasks-per-node=1" in line
    good = cli("validate", str(recipe), *sets)
    assert good.returncode == 0, good.stderr
    bad = cli("validate", str(recipe), *sets, "--set", "trainer.megatron.pp=3", "--set", "trainer.num_ranks=24")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "pp=3 does not divide the model's 64 layers" in bad.stderr
    heads = cli("validate", str(recipe), *sets, "--set", "trainer.megatron.tp=16", "--set", "trainer.num_ranks=128")
    assert heads.returncode == 2 and "tp=16" in heads.stderr and "Traceback" not in heads.stderr


def test_bad_torchrun_layouts_are_one_error(tmp_path: Path) -> None:
    cfg = load_recipe(DEMO, ["trainer.num_ranks=4", "launch.trainer.launcher=torchrun",
                             "launch.trainer.tasks_per_node=2"])
    with pytest.raises(UserError, match=r"nodes x tasks_per_node = 2 processes but the role has 4 ranks"):
        render_run(RunDir(tmp_path / "run"), cfg)
    with pytest.raises(ConfigError, match="torchrun starts trainer ranks only"):
        load_recipe(DEMO, ["launch.rollout.launcher=torchrun"])


def test_rank_and_exit_status_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    from relax_hpc.cli.role import default_rank

    monkeypatch.delenv("RELAX_RANK", raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")  # the node's one task
    monkeypatch.setenv("RANK", "5")
    assert default_rank() == 1  # not under torchrun: RANK is somebody else's
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "relax-7")
    assert default_rank() == 5
    assert exit_status([]) == 0 and exit_status([3, 3]) == 3 and exit_status([3, 1]) == 1
    assert exit_status([-9]) == 137
    assert launcher_args(["--nnodes=1", "x.py"])[0].endswith("SIGUSR2") and launcher_args(["a"])[-1] == "a"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


@pytest.mark.integration
def test_torchrun_tp2_colocate_checkpoints_on_sigusr2_and_resumes(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    run = tmp_path / "run"
    sets = ["num_steps=6", "warmup.steps=2", "trainer.backend=megatron", "trainer.num_ranks=2", "trainer.megatron.tp=2",
            "launch.trainer.launcher=torchrun", "launch.trainer.tasks_per_node=2", "rollout.prompts_per_step=8"]
    torchrun_colocate_preempted(run, sets, _env())
    from relax_hpc.trainer.checkpoint import latest_checkpoint

    latest = latest_checkpoint(RunDir(run))
    assert latest is not None and (latest / "COMPLETE").is_file()
    stopped = int(latest.name.split("_")[-1])
    assert 2 <= stopped < 6
    assert any(e.get("event") == "preempted" for e in events(run, "colocate-0"))
    p = torchrun_colocate(run, _env())
    assert p.wait(timeout=400) == 0, p.stderr.read()[-3000:] if p.stderr else ""
    status = json.loads((run / "STATUS.json").read_text())
    assert (status["state"], status["steps"]) == ("completed", 6)
    steps = [rec["step"] for rec in metrics(run, "colocate-0") if "rollout/reward" in rec["metrics"]]
    assert steps == list(range(1, 7)), steps  # every step once across the restart
