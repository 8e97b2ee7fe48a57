"""Background checkpoints on one GPU: the content is copied into pinned host buffers on a side CUDA stream.

A background checkpoint (``trainer.async_checkpoint``) used to take its content with synchronous copies of every
weight and optimizer tensor to pageable host memory (the Qwen3-4B shape: 24 GB) and then clone them once more, all
on the loop's thread. :func:`capture_on_gpu` instead asks the backend for its asynchronous host copy
(:meth:`~relax_hpc.trainer.backend.TrainerBackend.host_copy_async` with the optimizer: device-to-host copies into
pinned buffers kept for the next checkpoint, on a side stream after the current optimizer step; the next optimizer
step waits for them on the GPU, no host sync); the writer thread waits for the copies before it serialises (the
session waits for the previous write before taking a new one). The checkpoint's files and format are those of
:func:`relax_hpc.trainer.checkpoint.capture` (same names, tied tensors once). A backend without that copy returns
None (the caller takes the content as before).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from relax_hpc.trainer.checkpoint import CheckpointData, rng_state

if TYPE_CHECKING:
    from relax_hpc.trainer.backend import TrainerBackend


def capture_on_gpu(trainer: TrainerBackend) -> tuple[CheckpointData, Callable[[], None]] | None:
    """(the checkpoint's content in pinned host buffers, a function that waits until the copies are done), or None
    where this does not apply. The buffers are reused by the next call: write the previous content first."""
    host = trainer.host_copy_async(optimizer=True)
    if host is None:
        return None
    import torch

    assert host.optimizer is not None
    optim = {f"{p}::{k}": (v if isinstance(v, torch.Tensor) else torch.tensor(v))
             for p, st in host.optimizer["state"].items() for k, v in st.items()}
    rng_js, rng_t = rng_state()
    return CheckpointData(host.model, host.aliases, optim, host.optimizer["param_groups"], rng_js, rng_t), host.wait
