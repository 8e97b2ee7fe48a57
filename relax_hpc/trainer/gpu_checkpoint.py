"""Background checkpoints on one GPU: the content is copied into pinned host buffers on a side CUDA stream.

A background checkpoint (``trainer.async_checkpoint``) used to take its content with synchronous copies of every
weight and optimizer tensor to pageable host memory (the Qwen3-4B shape: 24 GB) and then clone them once more, all
on the loop's thread. :func:`capture_on_gpu` instead enqueues one device-to-host copy per tensor into pinned buffers
that are kept for the next checkpoint (the session waits for the previous write before taking a new one), on a side
stream after the current optimizer step; the next optimizer step waits for the copy on the GPU (an optimizer step
pre-hook, no host sync), and the writer thread waits for the copy's event before it serialises. The checkpoint's
files and format are those of :func:`relax_hpc.trainer.checkpoint.capture` (same names, tied tensors once).
Anything other than one CUDA rank training the HF module itself returns None (the caller takes the content as before).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from relax_hpc.trainer.backend import hf_module_on_one_gpu
from relax_hpc.trainer.checkpoint import CheckpointData, dedupe_shared, rng_state


def _pinned(cache: dict[str, Any], key: str, v: Any) -> Any:
    import torch

    buf = cache.get(key)
    if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
        buf = cache[key] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
    return buf


def capture_on_gpu(trainer: Any) -> tuple[CheckpointData, Callable[[], None]] | None:
    """(the checkpoint's content in pinned host buffers, a function that waits until the copies are done), or None
    where this does not apply. The buffers are reused by the next call: write the previous content first."""
    if not hf_module_on_one_gpu(trainer):
        return None
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    unique, aliases = dedupe_shared({k: v.detach() for k, v in trainer.model.state_dict().items()})
    osd = get_optimizer_state_dict(trainer.model, trainer.optimizer, options=StateDictOptions(full_state_dict=True))
    optim = {f"{p}::{k}": (v if isinstance(v, torch.Tensor) else torch.tensor(v))
             for p, st in osd["state"].items() for k, v in st.items()}
    groups = copy.deepcopy(osd["param_groups"])
    rng_js, rng_t = rng_state()
    cache = trainer.__dict__.setdefault("_checkpoint_buffers", {})
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # after this step's optimizer update
    out: list[dict[str, Any]] = [{}, {}]
    with torch.cuda.stream(stream):
        for i, (prefix, src) in enumerate((("model.", unique), ("optim.", optim))):
            for k, v in src.items():
                v = v.detach()
                if v.is_cuda:
                    out[i][k] = _pinned(cache, prefix + k, v)
                    out[i][k].copy_(v, non_blocking=True)
                else:
                    out[i][k] = v.clone().contiguous()
        event = torch.cuda.Event()
        event.record(stream)
    trainer._checkpoint_copy = event
    if not getattr(trainer, "_checkpoint_hook", None):
        def wait_for_copy(*_: Any) -> None:
            pending = getattr(trainer, "_checkpoint_copy", None)
            if pending is not None:
                torch.cuda.current_stream().wait_event(pending)

        trainer._checkpoint_hook = trainer.optimizer.register_step_pre_hook(wait_for_copy)
    return CheckpointData(out[0], aliases, out[1], groups, rng_js, rng_t), event.synchronize
