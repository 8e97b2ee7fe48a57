"""megatron's dist_checkpointing as the run loop's checkpoint format (``trainer.megatron.checkpoint_format: dist``,
the default with the distributed optimizer), with real processes over gloo and real files.

The session-level runs (tests/helpers/megatron_ckpt_worker.py; two ranks under torchrun = TP=1 x DP=2, or one rank):

1. DP=2: run F (format ``full``) to step 2; run B (``dist``) to step 4, whose rank 1 dies in the middle of step 4's
   checkpoint (its shards written, its part not). B's step 2 is a dist checkpoint; step 4 was never published
   (LATEST stays 2, only ``.tmp-`` debris). A copy B1 of B is taken.
2. DP=1: B1 resumes from step 2 (the half-written step 4 ignored) and F from its full step 2, both to step 4: the
   same weights, bit for bit (a DP=2 dist checkpoint loads at DP=1 exactly as the full one does).
3. DP=2: B resumes from step 2 to step 4: the weights of the run that went through step 4 without stopping, bit for
   bit. Then B1 (a dist checkpoint written at DP=1) and F go on at DP=2 to step 6: the same weights, bit for bit.

Then the files: a published dist checkpoint with one rank's shard file missing is passed over for the older one,
and a dist checkpoint is refused in one line by the torch backend and at another TP size. The run loop through the
CLI (colocate, torchrun with two ranks, SIGUSR2, resumed as one rank) is the last test; the schema's one-line error
is in tests/unit/test_config.py style here too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install -e '.[megatron]'")

from relax_hpc.config.load import load_recipe
from relax_hpc.errors import ConfigError, UserError
from relax_hpc.rundir import RunDir
from relax_hpc.trainer.checkpoint import latest_checkpoint, read_checkpoint_state
from tests.helpers.runutil import DEMO, REPO, cli, events, metrics, torchrun_colocate_preempted

WORKER = REPO / "tests" / "helpers" / "megatron_ckpt_worker.py"


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests" / "helpers"),
                                              os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
            "CUDA_VISIBLE_DEVICES": ""}


def _worker(out: Path, specs: list[dict[str, Any]], *, ranks: int) -> subprocess.CompletedProcess[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] \
        if ranks > 1 else [sys.executable]
    return subprocess.run([*launcher, str(WORKER), str(out), json.dumps(specs)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=600)


def _weights(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _bitwise(a: Path, b: Path) -> None:
    import torch

    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])][:5]


def _resumed_from(out: Path, name: str) -> tuple[int, int]:
    got = json.loads((out / f"{name}.json").read_text())
    return got["resumed_from"], got["dp_size"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three worker launches of the module docstring; the run dirs and outputs for the tests to look at."""
    root = tmp_path_factory.mktemp("megatron_ckpt")
    d = {k: root / k for k in ("B", "B0", "B1", "F", "out1", "out2", "out3")}
    for k in ("out1", "out2", "out3"):
        d[k].mkdir()
    first = _worker(d["out1"], [{"name": "F", "dir": str(d["F"]), "format": "full", "steps": 2},
                                {"name": "B", "dir": str(d["B"]), "format": "dist", "steps": 4, "crash_at": 4}],
                    ranks=2)
    assert first.returncode != 0, "rank 1 was to die in step 4's checkpoint"
    assert (d["out1"] / "B.safetensors").is_file(), first.stderr[-4000:]
    shutil.copytree(d["B"], d["B0"])  # as the crash left it, to look at
    shutil.copytree(d["B"], d["B1"])
    second = _worker(d["out2"], [{"name": "B1", "dir": str(d["B1"]), "format": "dist", "steps": 4},
                                 {"name": "F", "dir": str(d["F"]), "format": "full", "steps": 4}], ranks=1)
    assert second.returncode == 0, second.stderr[-4000:]
    third = _worker(d["out3"], [{"name": "B", "dir": str(d["B"]), "format": "dist", "steps": 4},
                                {"name": "B1", "dir": str(d["B1"]), "format": "dist", "steps": 6},
                                {"name": "F", "dir": str(d["F"]), "format": "full", "steps": 6}], ranks=2)
    assert third.returncode == 0, third.stderr[-4000:]
    return d


def _dist_layout(path: Path, world_size: int) -> None:
    state = read_checkpoint_state(path)
    assert state["sharded"]["format"] == "megatron" and state["sharded"]["world_size"] == world_size
    assert state["sharded"]["layout"]["trainer.megatron.tp"] == 1
    assert (path / "megatron" / "metadata.json").is_file() and (path / "rng.safetensors").is_file()
    assert not (path / "model.safetensors").exists() and not list(path.glob("part-r*.json"))
    ranks = {name.split("/")[-1].split("_")[2] for name in state["sharded"]["files"] if name.endswith(".distcp")}
    assert ranks == {str(r) for r in range(world_size)}  # every rank wrote its own shards


@pytest.mark.integration
def test_a_rank_dying_mid_save_leaves_the_previous_checkpoint_the_latest(runs: dict[str, Path]) -> None:
    b0 = RunDir(runs["B0"])  # B as the crash left it
    assert (b0.checkpoints_latest.read_text().strip(), latest_checkpoint(b0)) == ("2", b0.checkpoint(2))
    assert not b0.checkpoint(4).exists()
    staging = b0.checkpoint_staging(4)
    assert list((staging / "megatron").glob("__1_*.distcp")) and not (staging / "part-r00001.json").exists()
    _dist_layout(b0.checkpoint(2), world_size=2)
    assert _resumed_from(runs["out2"], "B1") == (2, 1)  # the resume took step 2


@pytest.mark.integration
def test_dist_checkpoint_of_dp2_resumes_at_dp1_like_the_full_one(runs: dict[str, Path]) -> None:
    assert _resumed_from(runs["out2"], "B1") == (2, 1) and _resumed_from(runs["out2"], "F") == (2, 1)
    _bitwise(runs["out2"] / "B1.safetensors", runs["out2"] / "F.safetensors")
    assert "sharded" not in read_checkpoint_state(RunDir(runs["F"]).checkpoint(2))  # format full stays full


@pytest.mark.integration
def test_resumed_run_continues_exactly_like_the_uninterrupted_one(runs: dict[str, Path]) -> None:
    assert _resumed_from(runs["out3"], "B") == (2, 2)
    _bitwise(runs["out3"] / "B.safetensors", runs["out1"] / "B.safetensors")  # step 4, with and without a stop
    _dist_layout(RunDir(runs["B"]).checkpoint(4), world_size=2)


@pytest.mark.integration
def test_dist_checkpoint_of_dp1_resumes_at_dp2_like_the_full_one(runs: dict[str, Path]) -> None:
    assert _resumed_from(runs["out3"], "B1") == (4, 2) and _resumed_from(runs["out3"], "F") == (4, 2)
    _dist_layout(RunDir(runs["B1"]).checkpoint(4), world_size=1)
    _bitwise(runs["out3"] / "B1.safetensors", runs["out3"] / "F.safetensors")


@pytest.mark.integration
def test_a_published_checkpoint_missing_a_ranks_shards_is_passed_over(runs: dict[str, Path], tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["B"], run)
    rd = RunDir(run)
    assert latest_checkpoint(rd) == rd.checkpoint(4)
    for f in (rd.checkpoint(4) / "megatron").glob("__1_*.distcp"):
        f.unlink()
    assert latest_checkpoint(rd) == rd.checkpoint(2)
    (rd.checkpoint(2) / "megatron" / ".metadata").write_bytes(b"x")  # a size that state.json did not record
    assert latest_checkpoint(rd) is None


def _session(cfg: Any, run: Path, trainer: Any) -> Any:
    from relax_hpc.events import EventLog
    from relax_hpc.trainer.session import TrainerSession

    rd = RunDir(run)
    return TrainerSession(rd, cfg, trainer, None, EventLog(rd, "trainer", 0))


@pytest.mark.integration
def test_a_dist_checkpoint_is_one_error_in_the_torch_backend_and_at_another_tp(runs: dict[str, Path],
                                                                                tmp_path: Path) -> None:
    import torch

    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.trainer.backend import make_backend
    from tests.helpers.backend_conformance import make_cfg

    run = tmp_path / "run"
    shutil.copytree(runs["B"], run)
    tok = build_digits_tokenizer()
    cfg = make_cfg()
    torch_backend = make_backend(cfg, rank=0, world_size=1, device="cpu", dtype=torch.float32,
                                 algorithm=get_algorithm("grpo"), tokenizer=tok)
    with pytest.raises(UserError, match=r"step_00000004 is a 'megatron' sharded checkpoint, which loads only with "
                                        r"trainer\.backend: \"megatron\" \(this run has trainer\.backend: \"torch\""
                                        r"\); .*checkpoint_format: full") as err:
        _session(cfg, run, torch_backend).resume()
    assert "\n" not in str(err.value)

    class NoSharded:  # a TP=2 megatron trainer, as far as the session looks before it loads anything
        step = 0

        def sharded_checkpoint(self) -> None:
            return None

    tp2 = make_cfg(trainer={"backend": "megatron", "num_ranks": 2, "megatron": {"tp": 2}})
    with pytest.raises(UserError, match=r"loads only with trainer\.megatron\.tp: 1 \(this run has "
                                        r"trainer\.megatron\.tp: 2\)"):
        _session(tp2, run, NoSharded()).resume()


def test_dist_without_the_distributed_optimizer_is_one_error_line() -> None:
    with pytest.raises(ConfigError) as err:
        load_recipe(DEMO, ["trainer.backend=megatron", "trainer.megatron.distributed_optimizer=false",
                           "trainer.megatron.checkpoint_format=dist"])
    assert len(err.value.problems) == 1 and "\n" not in err.value.problems[0]
    assert "distributed_optimizer: true" in err.value.problems[0] and "checkpoint_format: full" in str(err.value)
    proc = cli("validate", str(DEMO), "--set", "trainer.backend=megatron", "--set",
               "trainer.megatron.distributed_optimizer=false", "--set", "trainer.megatron.checkpoint_format=dist")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    auto = load_recipe(DEMO, ["trainer.backend=megatron", "trainer.megatron.distributed_optimizer=false"])
    assert auto.trainer.megatron.checkpoint_format == "auto"  # full without the distributed optimizer


@pytest.mark.integration
def test_colocate_at_dp2_checkpoints_in_dist_on_sigusr2_and_resumes_at_dp1(tmp_path: Path) -> None:
    """The run loop through the CLI: two colocate ranks (TP=1 x DP=2) under torchrun write dist checkpoints; a
    SIGUSR2 checkpoints and exits for requeue; the run resumes as one rank (DP=1) and completes every step once."""
    run = tmp_path / "run"
    sets = ["num_steps=5", "warmup.steps=0", "trainer.backend=megatron", "trainer.num_ranks=2",
            "trainer.checkpoint_every=2", "launch.trainer.launcher=torchrun", "launch.trainer.tasks_per_node=2",
            "rollout.prompts_per_step=4", "rollout.n_samples=4"]
    torchrun_colocate_preempted(run, sets, _env())
    latest = latest_checkpoint(RunDir(run))
    assert latest is not None and 2 <= int(latest.name.split("_")[-1]) < 5
    _dist_layout(latest, world_size=2)
    assert any(e.get("event") == "preempted" for e in events(run, "colocate-0"))
    config = json.loads((run / "config.json").read_text())  # the same run, one trainer rank from now on
    config["trainer"]["num_ranks"] = 1
    config["launch"]["trainer"].update(launcher="srun", tasks_per_node=1)
    (run / "config.json").write_text(json.dumps(config))
    proc = cli("resume", str(run), "--wait", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    status = json.loads((run / "STATUS.json").read_text())
    assert (status["state"], status["steps"]) == ("completed", 5)
    steps = [rec["step"] for rec in metrics(run, "colocate-0") if "rollout/reward" in rec["metrics"]]
    assert steps == list(range(1, 6)), steps  # every step once across the restart
    resumed = [e for e in events(run, "colocate-0") if e.get("event") == "resumed"]
    assert resumed and resumed[-1]["checkpoint"] == str(latest)
    _dist_layout(RunDir(run).checkpoint(5), world_size=1)
