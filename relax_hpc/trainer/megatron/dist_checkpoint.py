"""megatron's ``dist_checkpointing`` as the run loop's checkpoint format of the megatron backend, and loading it
without running code from the checkpoint's pickles.

:class:`MegatronDistCheckpoint` is the backend's :class:`~relax_hpc.trainer.backend.ShardedCheckpoint`: the model
and the distributed optimizer in the ``dp_reshardable`` layout (:func:`relax_hpc.trainer.megatron.optim.
save_dist_checkpoint`), every rank writing its own shards into ``checkpoints/step_N/megatron/``. It loads at another
data-parallel size, not at another ``tp``/``pp`` (nor in the torch backend): its :meth:`~MegatronDistCheckpoint.
layout` names those settings, and the session refuses a checkpoint written with others in one line.

What megatron-core 0.16.1 (with torch 2.13's ``torch.distributed.checkpoint``) writes and how it reads it back:
``__<rank>_<n>.distcp`` (each rank's tensors, raw bytes), ``.metadata`` (torch DCP's index, a pickle, read with a
plain ``pickle.load``), ``common.pt`` (the non-sharded state, ``torch.save``; read with ``torch.load`` and no
``weights_only`` argument, i.e. torch's default, ``weights_only=True`` unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``
is set) and ``metadata.json``. The distributed optimizer's bucket sizes are megatron ``ShardedObject`` s, stored as
``torch.save`` bytes inside the ``.distcp`` files and read by torch DCP's planner with ``torch.load(...,
weights_only=False)``. :func:`restricted_unpickling` closes the two unrestricted loads while megatron loads a
checkpoint: ``.metadata`` goes through an unpickler that only builds torch DCP's own metadata dataclasses and enums,
torch sizes, dtypes, layouts and memory formats; the sharded objects and ``common.pt`` through
``torch.load(weights_only=True)`` (megatron-core 0.19 reads ``common.pt`` through its storage-client wrapper, which
this does not reach: there it is torch's default, ``weights_only=True``). megatron-core 0.19.2 writes the same kinds
of objects into ``.metadata`` (its source read, not run here); a checkpoint from a megatron-core that pickled its own
classes there (the placeholder ``MCoreSavePlan`` of old releases) is refused with the class's name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import io
import pickle
import types
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_hpc.errors import UserError
from relax_hpc.trainer.backend import ShardedCheckpoint

if TYPE_CHECKING:
    from relax_hpc.trainer.megatron.host import CheckpointHost


class MegatronDistCheckpoint(ShardedCheckpoint):
    """The megatron backend's checkpoints in megatron's ``dist_checkpointing`` format (module docstring)."""

    name = "megatron"
    elsewhere = ("resume once at the checkpoint's settings with trainer.megatron.checkpoint_format: full; its next "
                 "checkpoint loads in either backend at any tp/pp")

    def __init__(self, backend: CheckpointHost, *, active: bool):
        self.backend = backend
        self.active = active

    def layout(self) -> dict[str, Any]:
        mc = self.backend.cfg.trainer.megatron
        return {"trainer.backend": "megatron", "trainer.megatron.tp": mc.tp, "trainer.megatron.pp": mc.pp,
                "trainer.megatron.distributed_optimizer": True, "trainer.megatron.vocab_multiple": mc.vocab_multiple}

    def save(self, folder: Path) -> None:
        _own_writer_queue()
        self.backend.save_dist_checkpoint(folder)

    def load(self, folder: Path) -> None:
        self.backend.load_dist_checkpoint(folder)

    def close(self) -> None:
        """Shut down the helper process megatron's checkpoint writer keeps once it has saved (:func:`_own_writer_queue`;
        it also goes when this process is gone)."""
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        manager = getattr(getattr(filesystem_async, "_results_queue", None), "_manager", None)
        if manager is not None:
            manager.shutdown()
            filesystem_async._results_queue = None


def sharded_checkpoint(backend: CheckpointHost) -> MegatronDistCheckpoint | None:
    """The backend's :class:`MegatronDistCheckpoint` where it has the distributed optimizer (active per
    ``trainer.megatron.checkpoint_format``), else None; ``dist`` where the backend turned the distributed optimizer
    off (ranks sharing a GPU over gloo) is one :class:`UserError` naming the fix."""
    fmt = backend.cfg.trainer.megatron.checkpoint_format
    if not backend.dist_opt:
        if fmt == "dist":
            raise UserError("trainer.megatron.checkpoint_format: dist needs megatron's distributed optimizer, which "
                            "is off for this run (the ranks' groups are gloo with CUDA tensors: ranks sharing a GPU); "
                            "set trainer.megatron.checkpoint_format: full (or auto)")
        return None
    return MegatronDistCheckpoint(backend, active=fmt != "full")


def _own_writer_queue() -> None:
    """megatron's checkpoint writer sends its results through a queue of a multiprocessing manager it starts with
    ``spawn`` on the first save and keeps (a process beside the rank, in its process group). Left to megatron, that
    manager dies of the first SIGUSR2 (Slurm's time-limit warning, which torchrun forwards to the ranks' process
    groups), so the checkpoint the signal asks for fails; and it outlives a rank that ends with ``os._exit``
    (cli/role.py) or is killed, holding the rank's stdout and stderr. Here the manager is started first, through
    :func:`_writer_queue_process`."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(_writer_queue_process)
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager (``close`` shuts it down)


def _writer_queue_process() -> None:
    """The initializer of the manager process of :func:`_own_writer_queue`: the stop signals are the rank's to handle
    (ignored here: the checkpoint they trigger needs this process), and the process exits once its parent (the rank)
    is gone."""
    import os
    import signal
    import threading
    import time

    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# ---------------------------------------------------------------------------------------- loading without pickles
_TORCH_VALUES = ("dtype", "layout", "memory_format")


def _allowed(module: str, name: str) -> Any:
    """The global ``module.name`` if a DCP ``.metadata`` pickle may use it, else None: torch DCP's own dataclasses
    and enums, ``torch.Size``, torch dtypes, layouts (and torch's lookup of a layout by name) and memory formats,
    ``collections.OrderedDict``."""
    import torch

    if module.startswith("torch.distributed.checkpoint."):
        obj = getattr(importlib.import_module(module), name, None)
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
        return None
    if module == "torch":
        obj = getattr(torch, name, None)
        kinds = tuple(getattr(torch, k) for k in _TORCH_VALUES)
        return obj if obj is torch.Size or isinstance(obj, kinds) else None
    if (module, name) == ("torch.serialization", "_get_layout"):  # a layout by its name: how torch pickles one
        return torch.serialization._get_layout
    if (module, name) == ("collections", "OrderedDict"):
        import collections

        return collections.OrderedDict
    return None


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what :func:`_allowed` lets through; any other global is an error."""

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed(module, name)
        if obj is None:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a DCP index never "
                                         "holds: refusing to load it")
        return obj


class _RestrictedPickle(types.ModuleType):
    """``pickle`` as torch DCP's filesystem reader sees it inside :func:`restricted_unpickling`."""

    def __init__(self) -> None:
        super().__init__("pickle")

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)

    @staticmethod
    def load(file: Any, **_: Any) -> Any:
        return _MetadataUnpickler(file).load()


class _WeightsOnlyTorch(types.ModuleType):
    """``torch`` whose ``load`` always uses ``weights_only=True`` (megatron's common-state loader)."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)

    @staticmethod
    def load(*args: Any, **kwargs: Any) -> Any:
        import torch

        return torch.load(*args, **{**kwargs, "weights_only": True})


def _planner_class() -> type:
    """megatron's load planner with the sharded objects (``torch.save`` bytes) read ``weights_only``."""
    import torch
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

    class WeightsOnlyPlanner(MCoreLoadPlanner):  # type: ignore[misc,valid-type]
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return WeightsOnlyPlanner


@contextlib.contextmanager
def restricted_unpickling() -> Iterator[None]:
    """While megatron loads a ``dist_checkpointing`` checkpoint: no pickle of it may build anything but plain data
    (module docstring). Undone on exit."""
    from megatron.core.dist_checkpointing.strategies import common as mcore_common
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
    from torch.distributed.checkpoint import filesystem

    swaps = [(filesystem, "pickle", _RestrictedPickle()), (mcore_torch, "MCoreLoadPlanner", _planner_class()),
             (mcore_common, "torch", _WeightsOnlyTorch())]
    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in swaps]
    try:
        for module, attr, value in swaps:
            setattr(module, attr, value)
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)
