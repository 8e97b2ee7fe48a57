"""Weight hand-over off the step's critical path (colocate on one GPU).

In colocate the engine generates with the trainer's own module, so nothing has to be copied for generation; the
snapshot files are for the monitor, late joiners and recovery. Writing them used to start with a synchronous copy of
every weight to pageable host memory on the loop's thread (4B shape: ~8 GB, 3.6-4.5 s per step).
:class:`BackgroundHandover` instead:

- keeps one set of **pinned host buffers** (allocated at the first hand-over);
- enqueues the device-to-host copies on a **side CUDA stream** after the optimizer step (the loop does not wait;
  generation, which only reads the weights, runs beside the copy);
- makes the next **optimizer step wait on the GPU** for the copy (an optimizer step pre-hook: no host sync), so the
  copy always sees this version's weights;
- writes the snapshot on the snapshot thread of :class:`~relax_hpc.modes.trainer_role.SnapshotFiles` (whose
  ``drain``/``close`` wait for it) once the copy's event has completed;
- **skips a version** while the previous one is still being written (the disk is slower than a step at large
  shapes; the files then lag by a version, the generation weights never do); ``final=True`` always publishes.

Anything other than one CUDA rank (CPU, FSDP) publishes as before: ``files.submit(version, full_state_dict())``.
The colocate loop calls :func:`hand_over` once per publishing step (``handover_for`` keeps the object on the files).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from relax_hpc.trainer.backend import hf_module_on_one_gpu


class BackgroundHandover:
    """Pinned host copies of one trainer's weights, refreshed on a side stream, published in the background."""

    def __init__(self, files: Any, trainer: Any):
        self.files = files
        self.trainer = trainer
        self.model = trainer.model
        self.stream = torch.cuda.Stream()
        self.buffers: dict[str, torch.Tensor] = {}
        self.copied: torch.cuda.Event | None = None
        self.skipped = 0
        """Versions not written because the previous write was still running."""
        self._hook = trainer.optimizer.register_step_pre_hook(self._wait_for_copy)

    def _wait_for_copy(self, *_: Any) -> None:
        if self.copied is not None:
            torch.cuda.current_stream().wait_event(self.copied)

    def _alloc(self, sd: dict[str, torch.Tensor]) -> None:
        if self.buffers and all(k in self.buffers and self.buffers[k].shape == v.shape for k, v in sd.items()):
            return
        self.buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in sd.items()}

    def submit(self, version: int, *, final: bool = False) -> bool:
        """Hand ``version`` over; returns False when it was skipped (a write still running, not ``final``)."""
        files = self.files
        if files.pool is None:  # not the publishing rank
            return True
        pending = files.pending
        if pending is not None and not pending.done() and not final:
            self.skipped += 1
            return False
        files.drain()  # done (or final: wait); re-raises a failed write
        sd = {k: v.detach() for k, v in self.model.state_dict().items()}
        self._alloc(sd)
        self.stream.wait_stream(torch.cuda.current_stream())  # after this step's optimizer update
        with torch.cuda.stream(self.stream):
            for k, v in sd.items():
                self.buffers[k].copy_(v, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.copied = event
        bufs = dict(self.buffers)

        def write() -> None:
            event.synchronize()
            files._publish(version, bufs)

        files.last_submit = time.monotonic()
        files.pending = files.pool.submit(write)
        return True

    def close(self) -> None:
        self._hook.remove()


def hand_over(files: Any, trainer: Any, version: int, *, final: bool = False) -> float:
    """Publish the trainer's weights as ``version`` through ``files`` (a ``SnapshotFiles``); returns the seconds
    the caller's thread spent. One CUDA rank: :class:`BackgroundHandover` (kept on ``files``); else the plain
    synchronous copy and background write."""
    t0 = time.perf_counter()
    if not hf_module_on_one_gpu(trainer):
        files.submit(version, trainer.full_state_dict(copy=True), private=True)  # a copy nobody changes
        return time.perf_counter() - t0
    h = getattr(files, "_handover", None)
    if h is None or h.trainer is not trainer:
        h = BackgroundHandover(files, trainer)
        files._handover = h
    h.submit(version, final=final)
    return time.perf_counter() - t0
