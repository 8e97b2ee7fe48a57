"""The trainer backend seam: what the trainer-side loops (modes/) and the session need from a learner.

A backend owns the model being trained, its optimizer and its parallel layout. One optimizer step is
``begin_step()``, any number of ``accumulate(items)`` (forward + backward at once, whole groups with their advantages
set; micro-batch streaming calls it as groups arrive), then ``finish_step()``, which alone knows the step's global
loss normalisers (tokens or sequences over every micro-batch of every data-parallel rank): it scales the gradient,
steps the optimizer and returns the metrics. ``dp_rank``/``dp_size`` is the data-parallel layout the sample store's
consumer splits groups by; with tensor or pipeline parallelism it differs from the process rank and world size
(ranks of one model replica read the same groups).

Weights leave a backend only under HF names (the keys ``from_pretrained`` expects), as whole tensors on the CPU:
:meth:`TrainerBackend.full_state_dict` for snapshots and the fast path, :meth:`TrainerBackend.state_buckets` to
stream them in bounded pieces, :meth:`TrainerBackend.export_hf` for the final model.

Checkpoints come in two shapes: :meth:`TrainerBackend.checkpoint_state` gathers the whole model and optimizer state
under HF names to rank 0 (the project's format: loads in any backend, at any parallel layout); a backend that has a
:class:`ShardedCheckpoint` (:meth:`TrainerBackend.sharded_checkpoint`) lets every rank write its own shards instead
(no host holds the whole state; loads only at the layout it names).

A new backend plugs in as one module (or package) with a class implementing this ABC and a ``build(cfg, **kw)``
function, a ``trainer.backend`` value in the schema (and its own config section), and one entry in
:data:`BACKENDS`; the conformance suite ``tests/helpers/backend_conformance.py`` checks it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_hpc.errors import UserError

if TYPE_CHECKING:
    from torch import Tensor

    from relax_hpc.config.schema import RecipeConfig
    from relax_hpc.trainer.batch import TrainItem


class TrainerBackend(ABC):
    """A learner: optimizer steps over train items, its weights under HF names, checkpoint state and HF export."""

    step: int
    """Optimizer steps done (= the policy version of the current weights)."""
    rank: int
    """This process's rank among the trainer's processes."""
    world_size: int
    """The trainer's processes."""
    dp_rank: int
    """This process's data-parallel rank: the store consumer hands it that part of each step's groups."""
    dp_size: int
    """Data-parallel replicas (world_size / model-parallel size)."""
    state_on_every_rank: bool = False
    """Set by a mode whose every trainer rank needs the whole model (colocate with an engine that does not share the
    trainer's module): :meth:`full_state_dict` then returns it on every rank, not only on rank 0."""

    # ------------------------------------------------------------------ training
    @abstractmethod
    def begin_step(self) -> None:
        """Start an optimizer step (gradients zeroed, step sums reset)."""

    @abstractmethod
    def accumulate(self, items: list[TrainItem]) -> None:
        """Forward + backward over ``items`` now: whole groups, advantages set (this rank's share)."""

    @abstractmethod
    def finish_step(self) -> dict[str, float]:
        """Apply the step's global normalisers (all micro-batches, all ranks), clip, step the optimizer; the metrics
        of the whole step (the same on every rank). ``step`` grows by one."""

    def train_step(self, items: list[TrainItem]) -> dict[str, float]:
        """``begin_step`` + ``accumulate(items)`` + ``finish_step``."""
        self.begin_step()
        self.accumulate(items)
        return self.finish_step()

    # ------------------------------------------------------------------ weights out
    @abstractmethod
    def full_state_dict(self, *, copy: bool = False) -> dict[str, Tensor]:
        """The whole model under HF names, CPU tensors (every rank calls; rank 0 gets them, others may get ``{}``).
        ``copy=False`` may return the live parameters (valid until the next optimizer step); ``copy=True`` returns
        tensors nothing changes later."""

    def state_buckets(self, bucket_bytes: int) -> Iterator[dict[str, Tensor]]:
        """The whole model under HF names in buckets of about ``bucket_bytes`` (a tensor larger than that is a bucket
        of its own). Every rank iterates; rank 0 gets the tensors, the others empty buckets. Tensors are valid until
        the next optimizer step."""
        yield from bucketed(self.full_state_dict().items(), bucket_bytes)

    def detached(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """``state_dict`` with every tensor that is live weight storage copied (no collective; any rank)."""
        return {k: v.detach().clone() for k, v in state_dict.items()}

    @abstractmethod
    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` content of the model (snapshots and the export)."""

    def generation_config(self) -> dict[str, Any] | None:
        """The ``generation_config.json`` content, if the model has one (None: derived from the config)."""
        return None

    def adapter_config(self) -> dict[str, Any] | None:
        """Training a LoRA adapter (``model.lora``): ``{"config": adapter_config.json content, "base": {"path",
        "sha256"}}``, and then ``full_state_dict`` holds only the adapter's tensors (under PEFT's file names). None:
        full weights."""
        return None

    def generation_model(self) -> Any | None:
        """The live module an in-process engine may generate with (colocate shares it); None if there is none."""
        return None

    def host_copy_async(self, *, optimizer: bool = False) -> HostCopy | None:
        """Capability: the live weights (HF names, each storage once) and, with ``optimizer``, the optimizer's full
        state, copied into pinned host buffers by device-to-host copies enqueued on a side stream after the current
        step; the next optimizer step waits for them on the device (no host sync). The buffers are kept for the
        next call of the same kind (weights, or weights and optimizer): consume the previous copy first. Used by
        the colocate hand-over and background checkpoints. None (the default): the backend has no such copy (CPU,
        several ranks, a module not under HF names); use :meth:`full_state_dict` / :meth:`checkpoint_state`."""
        return None

    @abstractmethod
    def export_hf(self, path: Path | str, tokenizer: Any) -> None:
        """Write the model as an HF folder (safetensors, config, generation config, tokenizer) to ``path``, which is
        created; every rank calls, rank 0 writes. ``from_pretrained(path)`` then gives the same logits."""

    # ------------------------------------------------------------------ checkpoints
    @abstractmethod
    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model, optimizer) state for :mod:`relax_hpc.trainer.checkpoint` (every rank calls; rank 0 gets them)."""

    @abstractmethod
    def load_checkpoint_state(self, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None) -> None:
        """Restore what :meth:`checkpoint_state` gave (bitwise: continued training is identical)."""

    def sharded_checkpoint(self) -> ShardedCheckpoint | None:
        """The backend's sharded checkpoint format for this run (:class:`ShardedCheckpoint`: every rank writes its own
        shards), which the session dispatches on once; None (the default): checkpoints are :meth:`checkpoint_state`
        gathered to rank 0 in the project's format."""
        return None

    # ------------------------------------------------------------------ optional
    def sft_warmup(self, prompts: Any, tokenizer: Any, *, steps: int, lr: float, batch_size: int,
                   max_tokens: int) -> dict[str, float]:
        """Supervised warm-up steps on the (prompt, answer) pairs of ``prompts`` before RL; returns metrics."""
        raise UserError(f"trainer backend {type(self).__name__} has no supervised warm-up (set warmup.steps: 0)")


class ShardedCheckpoint(ABC):
    """A backend's own checkpoint format in which every rank writes its shards of the model and the optimizer into
    one folder (nothing is gathered to one host). The session gives it ``checkpoints/step_N/<name>/`` beside the state
    JSON; the leader publishes the step only after every rank's part is written. A checkpoint in this format loads
    only into a trainer whose recipe has the settings of :meth:`layout` (recorded in the checkpoint)."""

    name: str
    """The format's name: its folder in the step's checkpoint folder and the ``sharded.format`` of its state JSON."""
    active: bool
    """Whether this run's checkpoints are written in this format (else in the gathered one); a checkpoint in it is
    loaded either way."""
    elsewhere: str = ""
    """How to get a checkpoint that loads with other settings (said when a checkpoint in this format does not load)."""

    @abstractmethod
    def layout(self) -> dict[str, Any]:
        """The recipe settings (dotted config paths -> values) that a checkpoint in this format needs to load."""

    @abstractmethod
    def save(self, folder: Path) -> None:
        """Every rank calls with the same existing, empty ``folder``: writes this rank's shards (durable on return)."""

    @abstractmethod
    def load(self, folder: Path) -> None:
        """Every rank calls: the model and the optimizer state from ``folder`` (continued training is identical)."""

    def close(self) -> None:
        """Release what the writes keep between checkpoints (helper processes); the session calls it at its end."""
        return None


@dataclass
class HostCopy:
    """Pinned host copies of a backend's live state (:meth:`TrainerBackend.host_copy_async`), valid once
    :meth:`wait` returned and until the next copy of the same kind."""

    model: dict[str, Tensor]
    """The weights under HF names, each storage once (tied tensors under their first name)."""
    aliases: dict[str, str]
    """Tied name -> the name in :attr:`model` that holds its tensor."""
    optimizer: dict[str, Any] | None
    """The full optimizer state (``{"state": {hf_name: {key: value}}, "param_groups": [...]}``), its tensors on
    the host; None when not asked for."""
    event: Any
    """The CUDA event recorded after the copies."""

    def wait(self) -> None:
        """Block until the copies are done."""
        self.event.synchronize()

    def weights(self) -> dict[str, Tensor]:
        """Every weight under its HF name (tied names share the tensor of their first name)."""
        return {**self.model, **{a: self.model[t] for a, t in self.aliases.items()}}


class PinnedCopier:
    """The machinery of :meth:`TrainerBackend.host_copy_async` for one HF module and its optimizer on one GPU: one
    side stream, one set of pinned buffers per kind of copy, and one optimizer step pre-hook that makes the next
    step wait (on the GPU) for every copy enqueued before it."""

    def __init__(self, optimizer: Any):
        import torch

        self.stream = torch.cuda.Stream()
        self.buffers: dict[str, dict[str, Any]] = {}
        self.pending: dict[str, Any] = {}
        self.hook = optimizer.register_step_pre_hook(self._wait_for_copies)

    def _wait_for_copies(self, *_: Any) -> None:
        import torch

        for event in self.pending.values():
            torch.cuda.current_stream().wait_event(event)

    def _to_host(self, cache: dict[str, Any], key: str, v: Any) -> Any:
        import torch

        v = v.detach()
        if not v.is_cuda:
            return v.clone().contiguous()
        buf = cache.get(key)
        if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
            buf = cache[key] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
        buf.copy_(v, non_blocking=True)
        return buf

    def copy(self, model: Any, optimizer: Any = None, *, state: Mapping[str, Any] | None = None) -> HostCopy:
        """Enqueue the copies of ``model``'s state, or of ``state`` (the tensors to copy by name, e.g. a LoRA
        adapter's under PEFT's names), and ``optimizer``'s full state, when given."""
        import copy as copy_module

        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        kind = "weights" if optimizer is None else "checkpoint"
        named = model.state_dict() if state is None else state
        unique, aliases = dedupe_shared({k: v.detach() for k, v in named.items()})
        osd: dict[str, Any] | None = None if optimizer is None else dict(get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True)))
        cache = self.buffers.setdefault(kind, {})
        self.stream.wait_stream(torch.cuda.current_stream())  # after this step's optimizer update
        host_optim: dict[str, Any] | None = None
        with torch.cuda.stream(self.stream):
            host_model = {k: self._to_host(cache, "model." + k, v) for k, v in unique.items()}
            if osd is not None:
                state = {p: {k: self._to_host(cache, f"optim.{p}::{k}", v) if isinstance(v, torch.Tensor) else v
                             for k, v in st.items()} for p, st in osd["state"].items()}
                host_optim = {"state": state, "param_groups": copy_module.deepcopy(osd["param_groups"])}
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending[kind] = event
        return HostCopy(host_model, aliases, host_optim, event)

    def close(self) -> None:
        self.hook.remove()


BACKENDS: dict[str, str] = {
    "torch": "relax_hpc.trainer.torch_trainer",
    "megatron": "relax_hpc.trainer.megatron.backend",
}
"""``trainer.backend`` -> the module whose ``build(cfg, **kwargs)`` makes the backend."""


def bucketed(tensors: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[dict[str, Any]]:
    """``(name, tensor)`` pairs grouped in order into buckets of about ``bucket_bytes`` (a tensor larger than that
    is a bucket of its own)."""
    bucket: dict[str, Any] = {}
    size = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t
        size += n
    if bucket:
        yield bucket


def dedupe_shared(sd: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Drop tensors that share storage with an earlier one (tied embeddings); return (tensors, alias -> name)."""
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    out: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for name, t in sd.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        out[name] = t
    return out, aliases


def hf_module_on_one_gpu(trainer: Any) -> bool:
    """One CUDA rank whose trained module is the HF model itself, so that its ``state_dict()`` and optimizer are
    the snapshot's and the checkpoint's content as they stand (the torch backend on one GPU). The GPU-side copies of
    the hand-over and of background checkpoints take that path; any other backend (the megatron GPT is not
    HF-named) goes through ``full_state_dict`` / ``checkpoint_state``."""
    if getattr(trainer, "world_size", 1) != 1 or not hasattr(trainer, "optimizer"):
        return False
    if trainer.generation_model() is not trainer.model:
        return False
    p = next(trainer.model.parameters(), None)
    return p is not None and p.is_cuda


def make_backend(cfg: RecipeConfig, *, rank: int, world_size: int, device: str, dtype: Any, algorithm: Any,
                 tokenizer: Any, model: Any = None, ref_model: Any = None, teacher: Any = None) -> TrainerBackend:
    """The backend ``cfg.trainer.backend`` names (the one place that dispatches on it). ``model``: an already
    built policy module the backend may train (the torch backend needs one); ``ref_model``/``teacher``: the KL
    reference and the distillation teacher, when the recipe uses them."""
    name = cfg.trainer.backend
    module = importlib.import_module(BACKENDS[name])
    return module.build(cfg, rank=rank, world_size=world_size, device=device, dtype=dtype, algorithm=algorithm,
                        tokenizer=tokenizer, model=model, ref_model=ref_model, teacher=teacher)
