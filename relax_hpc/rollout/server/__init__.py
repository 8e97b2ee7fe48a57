"""Server engines (``sglang``, ``vllm``): an inference server process per engine, driven over HTTP.

:func:`make_server_engine` builds one from a recipe (dispatched once on ``rollout.engine``); the server itself starts
at the engine's first use, inside the event loop that drives it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_hpc.errors import UserError

if TYPE_CHECKING:
    from relax_hpc.config.schema import RecipeConfig
    from relax_hpc.rollout.engine import SnapshotFolder
    from relax_hpc.rollout.server.base import ServerEngine
    from relax_hpc.rundir import RunDir


def server_name(proc: str, index: int = 0) -> str:
    """``rollout-0`` + server 0 -> ``rollout-0-0`` (several servers per rollout task when TP < its GPUs)."""
    return f"{proc}-{index}"


def server_gpus(local_rank: int, index: int, gpus_per_server: int, visible: list[str], tasks_per_node: int
                ) -> list[str]:
    """The GPUs server ``index`` of the rollout task with node-local rank ``local_rank`` uses, out of the GPUs the
    task sees (``visible``). A task that sees only its own GPUs (``--gpus-per-task``) slices those; a task that sees
    the whole node's (``--gpus-per-node``, shared by ``tasks_per_node`` tasks) takes its share first."""
    if len(visible) >= gpus_per_server * tasks_per_node > gpus_per_server:  # the node's GPUs: take this task's share
        share = len(visible) // tasks_per_node
        visible = visible[local_rank * share:(local_rank + 1) * share]
    chosen = visible[index * gpus_per_server:(index + 1) * gpus_per_server]
    if len(chosen) < gpus_per_server:
        raise UserError(f"rollout server {index} of task {local_rank} needs {gpus_per_server} GPUs "
                        f"(rollout.server.gpus_per_server / tp_size) but the task sees {visible or 'none'}")
    return chosen


def colocate_gpu(device: str, visible: list[str]) -> str:
    """The GPU (as ``CUDA_VISIBLE_DEVICES`` names it) of a colocate rank's trainer on ``device`` (``cuda`` or
    ``cuda:N``, an index into the ``visible`` GPUs; all GPUs when none are named): its server shares it."""
    idx = int(device.split(":", 1)[1]) if ":" in device else 0
    if visible and idx >= len(visible):
        raise UserError(f"the trainer is on {device} but this process sees only GPUs {','.join(visible)}")
    return visible[idx] if visible else str(idx)


def _gpu_env(cfg: RecipeConfig, index: int, device: str = "cuda") -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` for a server on a GPU node (Slurm: from the task's local id; colocate: the GPU of
    the rank's trainer, ``device``)."""
    import os

    gpus = cfg.rollout.server.gpus_per_server or cfg.rollout.server.tp_size
    visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g != ""]
    if cfg.colocated and gpus == 1:
        return {"CUDA_VISIBLE_DEVICES": colocate_gpu(device, visible)}
    if not visible:
        return {}
    local = int(os.environ.get("SLURM_LOCALID", "0"))
    tasks = int(os.environ.get("SLURM_NTASKS_PER_NODE", os.environ.get("SLURM_TASKS_PER_NODE", "1")).split("(")[0])
    return {"CUDA_VISIBLE_DEVICES": ",".join(server_gpus(local, index, gpus, visible, tasks))}


def prepare_model_dir(cfg: RecipeConfig, target: Path, *, tokenizer: Any, seed: int) -> Path:
    """The HF folder the server starts from: ``model.path`` when it is a folder, else (``tiny``) the tiny model
    built with ``seed`` and saved with the tokenizer to ``target`` (the same weights the trainer starts with)."""
    m = cfg.model
    if m.path != "tiny":
        path = Path(m.path).expanduser()
        if not (path / "config.json").exists():
            raise UserError(f"model.path {m.path}: a server engine needs a local HF model folder (config.json)")
        return path
    if m.tiny.arch != "qwen3":
        raise UserError(f"model.tiny.arch={m.tiny.arch}: server engines serve text models here; use qwen3")
    if not (target / "config.json").exists():
        from relax_hpc.models.load import load_model

        model = load_model(m, tokenizer, device="cpu", dtype=_torch_dtype(m.dtype), seed=seed)
        target.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
    return target


def _torch_dtype(name: str) -> Any:
    import torch

    return torch.bfloat16 if name == "bfloat16" else torch.float32


def _max_len(model_dir: Path, cfg: RecipeConfig) -> int:
    try:
        conf = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        conf = {}
    want = cfg.data.max_prompt_tokens + cfg.rollout.sampling.max_new_tokens
    limit = int(conf.get("max_position_embeddings") or conf.get("text_config", {}).get("max_position_embeddings")
                or want)
    return min(limit, max(want, 64))


def make_server_engine(cfg: RecipeConfig, *, run_dir: RunDir, proc: str, device: str, seed: int, tokenizer: Any,
                       events: Any = None, index: int = 0) -> ServerEngine:
    """The ``sglang`` or ``vllm`` engine of rollout process ``proc`` (its server ``index``)."""
    from relax_hpc.rollout.server.base import ServerSetup

    name = server_name(proc, index)
    if cfg.rollout.engine == "vllm" and device != "cpu" and cfg.rollout.device == "auto" and not has_gpu():
        device = "cpu"  # vLLM's CPU build: its GPU defaults would reserve 92 % of the host's memory and fail
    model_dir = prepare_model_dir(cfg, run_dir.server_model(name), tokenizer=tokenizer, seed=cfg.model.init_seed)
    if cfg.rollout.engine == "vllm" and device == "cpu":
        check_cpu_head_dim(model_dir)
    dtype = "bfloat16" if cfg.model.dtype == "bfloat16" else ("float32" if device == "cpu" or
                                                              cfg.model.dtype == "float32" else "bfloat16")
    engine_args = cfg.rollout.sglang.server_args if cfg.rollout.engine == "sglang" else {}  # vllm has none
    setup = ServerSetup(name=name, model_dir=model_dir, record=run_dir.server_record(name),
                        log=run_dir.server_log(name), views=run_dir.server_views(name),
                        device="cpu" if device == "cpu" else "cuda", dtype=dtype,
                        max_model_len=_max_len(model_dir, cfg), seed=seed, eos_token_id=tokenizer.eos_token_id,
                        extra_server_args=dict(engine_args), newest=newest_snapshot(run_dir),
                        events=events, sleep_level=sleep_level(cfg), gpu_memory_utilization=memory_share(cfg))
    server_cfg = cfg.rollout.server
    if device != "cpu":
        env = {**_gpu_env(cfg, index, device), **server_cfg.env}
        server_cfg = server_cfg.model_copy(update={"env": env})
    kind = cfg.rollout.engine
    if kind == "vllm" and cfg.model.lora is not None:
        from relax_hpc.rollout.server.vllm_lora import VLLMLoraEngine

        return VLLMLoraEngine(server_cfg, setup, lora=cfg.model.lora, keep=cfg.max_staleness + 1)
    if kind == "vllm":
        from relax_hpc.rollout.server.vllm import VLLMEngine

        return VLLMEngine(server_cfg, setup)
    if kind == "sglang" and cfg.model.lora is not None:
        from relax_hpc.rollout.server.sglang_lora import SGLangLoraEngine

        return SGLangLoraEngine(server_cfg, setup, lora=cfg.model.lora, keep=cfg.max_staleness + 1)
    if kind == "sglang":
        from relax_hpc.rollout.server.sglang import SGLangEngine

        return SGLangEngine(server_cfg, setup)
    raise ValueError(f"rollout.engine={kind!r} is not a server engine")


COLOCATE_SLEEP_LEVEL = 2
"""``rollout.server.sleep_level`` unset in colocate: the weights are discarded while the trainer trains (the next
version is loaded on waking anyway, so a host copy would buy nothing)."""
COLOCATE_MEMORY_SHARE = 0.5
"""``rollout.server.gpu_memory_utilization`` unset in colocate: the server's share of the GPU (verl's default)."""


def sleep_level(cfg: RecipeConfig) -> int:
    """How deep a server of this recipe sleeps while the trainer trains (0 = never: fully_async, or set so)."""
    from relax_hpc.config.schema import ServerRolloutBase

    if not cfg.colocated or not isinstance(cfg.rollout, ServerRolloutBase):
        return 0
    level = cfg.rollout.server.sleep_level
    return COLOCATE_SLEEP_LEVEL if level is None else int(level)


def memory_share(cfg: RecipeConfig) -> float | None:
    """The server's share of its GPU's memory (None: the engine's default)."""
    from relax_hpc.config.schema import ServerRolloutBase

    if not isinstance(cfg.rollout, ServerRolloutBase):
        return None
    share = cfg.rollout.server.gpu_memory_utilization
    return COLOCATE_MEMORY_SHARE if share is None and cfg.colocated else share


VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The head sizes vLLM 0.32's CPU attention takes (``v1/attention/backends/cpu_attn.py``,
``get_supported_head_sizes``); another kills its engine core at the first request."""


def check_cpu_head_dim(model_dir: Path) -> None:
    """One clear error for a model vLLM's CPU build cannot serve (its attention head size), instead of a server that
    starts, dies at the first request and is restarted until the cap."""
    try:
        conf = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return
    conf = conf.get("text_config") or conf
    heads = conf.get("num_attention_heads")
    head_dim = conf.get("head_dim") or (conf["hidden_size"] // heads if heads and conf.get("hidden_size") else None)
    if head_dim is not None and int(head_dim) not in VLLM_CPU_HEAD_DIMS:
        raise UserError(f"rollout.engine=vllm on the CPU: the model's attention head size is {head_dim}, and vLLM's "
                        f"CPU attention takes {', '.join(map(str, VLLM_CPU_HEAD_DIMS))} (tiny model: set "
                        "model.tiny.hidden_size / num_heads to give 64, e.g. 128 / 2)")


def has_gpu() -> bool:
    """Whether this process sees a CUDA GPU (``rollout.device: auto`` puts a vllm server on the CPU otherwise)."""
    import torch

    return bool(torch.cuda.is_available())


def newest_snapshot(run_dir: RunDir) -> Any:
    """A callable giving the newest complete snapshot of the run (version, folder), or None before the first."""

    def newest() -> tuple[int, SnapshotFolder] | None:
        from relax_hpc.rollout.engine import SnapshotFolder
        from relax_hpc.weights.manifest import latest_version

        v = latest_version(run_dir)
        if v is None or not run_dir.snapshot(v).exists():
            return None
        return v, SnapshotFolder(run_dir.snapshot(v), verify="size")

    return newest
