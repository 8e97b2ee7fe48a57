"""The ``server`` transport (fully_async, server engines): trainer rank 0 broadcasts each new version straight
into the rollout servers over a process group per worker (:mod:`relax_hpc.weights.server_links`; the worker's end is
:class:`~relax_hpc.rollout.server.fastpath.ServerFastPath`, handed to the engine as its weight source). Every
version's files are written too; a failed broadcast falls back to them inside the engine (event
``weight_sync_fallback``) and a link that cannot be used to them in the receiver (event ``weight_fallback``).

Per engine, :data:`SERVER_ENGINES` says whether the trainer side is wired. SGLang's is a torch process group
(:mod:`relax_hpc.weights.server_links`); vLLM's weight-transfer engine needs vLLM's own NCCL group classes on the
trainer side (:mod:`relax_hpc.weights.vllm_transfer`: CUDA and the ``vllm`` package), so where the trainer has
neither, the servers load the files and the trainer says so (event ``weight_sync_files``).
"""

from __future__ import annotations

from typing import Any

SERVER_ENGINES: dict[str, bool] = {"sglang": True, "vllm": True}
"""``rollout.engine`` -> whether the ``server`` transport's broadcast is wired for it."""


def wired(engine: str) -> bool:
    return SERVER_ENGINES.get(engine, False)


def server_links(run_dir: Any, cfg: Any, *, device: str, events: Any = None) -> Any:
    """Trainer rank 0's links into the servers of the rollout workers; None where this trainer cannot serve the
    engine's weight transfer (one ``weight_sync_files`` event says why; the servers load the files)."""
    from relax_hpc.weights.server_links import ServerLinks

    if cfg.model.lora is not None:  # the servers load each adapter version from its folder (a few MB) by path
        if events is not None:
            events.event("weight_sync_files", "model.lora: the servers load each adapter version from its snapshot "
                         "folder by path")
        return None
    if cfg.rollout.engine == "vllm":
        from relax_hpc.weights.vllm_transfer import vllm_links

        return vllm_links(run_dir, cfg, device=device, events=events)
    num_workers, tp_size = cfg.rollout.num_workers, cfg.rollout.server.tp_size
    timeout_s = cfg.rollout.server.sync_timeout_s

    return ServerLinks(run_dir, num_workers, world_size=1 + tp_size,
                       backend="nccl" if device.startswith("cuda") else "gloo", timeout_s=timeout_s, device=device)
