"""The ``server`` transport (fully_async, server engines): trainer rank 0 broadcasts each new version straight
into the rollout servers over a process group per worker (:mod:`relax_hpc.weights.server_links`; the worker's end is
:class:`~relax_hpc.rollout.server.fastpath.ServerFastPath`, handed to the engine as its weight source). Every
version's files are written too; a failed broadcast falls back to them inside the engine (event
``weight_sync_fallback``) and a link that cannot be used to them in the receiver (event ``weight_fallback``).

Per engine, :data:`SERVER_ENGINES` says whether the trainer side is wired: SGLang's is; vLLM's weight-transfer engine
needs its NCCL communicator on the trainer side (a module of its own, e.g. ``relax_hpc.weights.vllm_transfer``, plugs
in here), so until then a vllm worker loads the files and says so (event ``weight_sync_files``).
"""

from __future__ import annotations

from typing import Any

SERVER_ENGINES: dict[str, bool] = {"sglang": True, "vllm": False}
"""``rollout.engine`` -> whether the ``server`` transport's broadcast is wired for it."""


def wired(engine: str) -> bool:
    return SERVER_ENGINES.get(engine, False)


def server_links(run_dir: Any, num_workers: int, *, tp_size: int, device: str, timeout_s: float) -> Any:
    """Trainer rank 0's links into the servers of rollout workers ``0..num_workers-1``."""
    from relax_hpc.weights.server_links import ServerLinks

    return ServerLinks(run_dir, num_workers, world_size=1 + tp_size,
                       backend="nccl" if device.startswith("cuda") else "gloo", timeout_s=timeout_s, device=device)
