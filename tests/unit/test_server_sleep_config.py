"""Colocate with a server engine, as configured: ``rollout.server.sleep_level`` (0 never, 1 weights kept in host
memory, 2 discarded; 2 when unset in colocate) and ``rollout.server.gpu_memory_utilization`` (0.5 when unset in
colocate), what each engine starts its server with for them, and the one-line refusals."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.config.load import validate_dict
from relax_hpc.errors import ConfigError, UserError
from relax_hpc.rollout.server import memory_share, sleep_level

BASE: dict[str, Any] = {"data": {"task": {"name": "reverse_digits"}}, "model": {"path": "tiny"}}


def cfg(**sections: Any) -> Any:
    return validate_dict({**BASE, **sections})


@pytest.mark.parametrize(("sections", "level", "share"), [
    ({"rollout": {"engine": "vllm"}}, 2, 0.5),
    ({"rollout": {"engine": "sglang", "server": {"sleep_level": 1, "gpu_memory_utilization": 0.3}}}, 1, 0.3),
    ({"rollout": {"engine": "vllm", "server": {"sleep_level": 0}}}, 0, 0.5),
    ({"mode": "fully_async", "rollout": {"engine": "vllm"}}, 0, None),
    ({"mode": "fully_async", "rollout": {"engine": "vllm", "server": {"sleep_level": 0,
                                                                      "gpu_memory_utilization": 0.8}}}, 0, 0.8),
    ({}, 0, None),  # hf: no server
])
def test_sleep_level_and_memory_share(sections: dict[str, Any], level: int, share: float | None) -> None:
    c = cfg(**sections)
    assert sleep_level(c) == level and memory_share(c) == share


@pytest.mark.parametrize(("sections", "message"), [
    ({"mode": "fully_async", "rollout": {"engine": "vllm", "server": {"sleep_level": 2}}},
     "rollout.server.sleep_level=2: only colocate puts its servers to sleep"),
    ({"rollout": {"engine": "vllm"}, "weights": {"publish_every": 5}},
     "weights.publish_every=5: in colocate a server engine loads every version from its snapshot files; use 1"),
    ({"rollout": {"engine": "vllm", "server": {"sleep_level": 3}}}, "rollout.server.sleep_level"),
    ({"rollout": {"engine": "vllm", "server": {"gpu_memory_utilization": 1.0}}},
     "rollout.server.gpu_memory_utilization"),
    ({"rollout": {"engine": "hf", "server": {"sleep_level": 1}}}, "rollout.server"),  # hf has no server section
])
def test_refused_in_one_line(sections: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as got:
        cfg(**sections)
    assert "\n" not in str(got.value).strip(), str(got.value)


def _engine(kind: str, device: str, level: int, share: float | None) -> Any:
    from relax_hpc.config.rollout import ServerConfig
    from relax_hpc.rollout.server.base import ServerSetup
    from relax_hpc.rollout.server.sglang import SGLangEngine
    from relax_hpc.rollout.server.vllm import VLLMEngine

    setup = ServerSetup(name="colocate-0-0", model_dir=Path("/m"), record=Path("/r.json"), log=Path("/l.log"),
                        device=device, sleep_level=level, gpu_memory_utilization=share)
    return (VLLMEngine if kind == "vllm" else SGLangEngine)(ServerConfig(), setup)


def test_vllm_server_arguments() -> None:
    gpu = _engine("vllm", "cuda", 2, 0.5).server_args(Path("/m"), 1)
    assert "--enable-sleep-mode" in gpu and gpu[gpu.index("--gpu-memory-utilization") + 1] == "0.5"
    assert "--enable-sleep-mode" not in _engine("vllm", "cuda", 0, None).server_args(Path("/m"), 1)
    cpu = _engine("vllm", "cpu", 2, 0.5).server_args(Path("/m"), 1)  # the CPU build refuses --enable-sleep-mode
    assert "--enable-sleep-mode" not in cpu and cpu[cpu.index("--gpu-memory-utilization") + 1] == "0.1"
    assert "--enforce-eager" in cpu and "--enforce-eager" not in gpu  # no compile warm-up on the CPU


def test_a_cpu_server_compiles_when_the_extra_arguments_say_so() -> None:
    from relax_hpc.rollout.server.process import build_argv

    engine = _engine("vllm", "cpu", 0, None)
    argv = build_argv("python -m vllm", engine.server_args(Path("/m"), 1), ["--no-enforce-eager"])
    assert argv.index("--no-enforce-eager") > argv.index("--enforce-eager")  # argparse: the last one wins


def test_vllm_cpu_server_threads_are_not_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's "auto" binding pins every CPU server's worker to one core; the engine asks for none unless told."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert _engine("vllm", "cpu", 0, None).server_env()["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in _engine("vllm", "cuda", 0, None).server_env()
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")  # the user's own choice stands
    assert "VLLM_CPU_OMP_THREADS_BIND" not in _engine("vllm", "cpu", 0, None).server_env()


def test_sglang_server_arguments() -> None:
    two = _engine("sglang", "cuda", 2, 0.4).server_args(Path("/m"), 1)
    assert "--enable-memory-saver" in two and "--enable-weights-cpu-backup" not in two
    assert two[two.index("--mem-fraction-static") + 1] == "0.4"
    one = _engine("sglang", "cuda", 1, None).server_args(Path("/m"), 1)
    assert "--enable-weights-cpu-backup" in one and "--mem-fraction-static" not in one
    assert "--enable-memory-saver" not in _engine("sglang", "cuda", 0, None).server_args(Path("/m"), 1)


def test_engines_declare_sleep() -> None:
    from relax_hpc.rollout.engine import RolloutEngine
    from relax_hpc.rollout.hf_engine import HFEngine

    assert _engine("vllm", "cpu", 2, None).can_sleep and _engine("sglang", "cpu", 2, None).can_sleep
    assert not RolloutEngine.can_sleep and not HFEngine.can_sleep


def test_preflight_lets_a_colocate_server_use_the_gpu_beside_a_cpu_trainer() -> None:
    """The in-process engine generates with the trainer's model, so ``rollout.device: cuda`` beside a CPU trainer is
    refused; a server engine runs on its own ``rollout.device``, so the same recipe is no contradiction (the check
    then only asks whether the machine has a GPU)."""
    from relax_hpc.launch.preflight import CannotRunHere, check_devices

    with pytest.raises(UserError, match="generates with the trainer's model"):
        check_devices(cfg(rollout={"device": "cuda"}, trainer={"device": "cpu"}), "local")
    try:
        check_devices(cfg(rollout={"engine": "vllm", "device": "cuda"}, trainer={"device": "cpu"}), "local")
    except CannotRunHere as exc:  # a machine without a GPU: the device check, not the contradiction
        assert "rollout.device is cuda but this machine has no CUDA device" in str(exc)


def test_a_colocate_server_takes_its_ranks_gpu() -> None:
    from relax_hpc.rollout.server import colocate_gpu

    assert colocate_gpu("cuda:1", ["4", "5"]) == "5" and colocate_gpu("cuda", ["4", "5"]) == "4"
    assert colocate_gpu("cuda:3", []) == "3"  # every GPU visible: the index is the GPU
    with pytest.raises(UserError, match="sees only GPUs 4"):
        colocate_gpu("cuda:1", ["4"])
