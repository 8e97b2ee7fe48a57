"""What the pipeline schedule and the dist_checkpointing format need of the megatron backend, as Protocols: they
annotate with these instead of importing :class:`~relax_hpc.trainer.megatron.backend.MegatronBackend`, which imports
them (no import circle)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol

import torch

from relax_hpc.config.schema import RecipeConfig


class PipelineHost(Protocol):
    """The backend as :mod:`relax_hpc.trainer.megatron.pipeline` drives it: its stage, model and shapes."""

    dtype: torch.dtype
    gpt: Any
    """The megatron GPT module of this stage (``set_input_tensor``)."""
    model: Any
    """The stage's model as the backend calls it (``input_ids``, ``position_ids``, ``attention_mask``)."""
    packing: Any
    """The packed-sequence attention context (``use(lengths, positions)``)."""
    stage: Any
    """This rank's pipeline stage (``first``, ``last`` and its neighbours)."""
    shape: Any
    """The model's shape (``hidden_size``, ``vocab_size``)."""
    sequence_logprobs: Callable[..., Any]
    gather_vocab: Callable[[torch.Tensor], torch.Tensor]
    compiled_ctx: Callable[[], AbstractContextManager[Any]]


class CheckpointHost(Protocol):
    """The backend as :mod:`relax_hpc.trainer.megatron.dist_checkpoint` saves and loads it."""

    cfg: RecipeConfig
    dist_opt: bool

    def save_dist_checkpoint(self, folder: Path) -> None: ...

    def load_dist_checkpoint(self, folder: Path) -> None: ...
