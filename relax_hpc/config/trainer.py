"""The ``trainer`` section: the learner; ``trainer.backend`` selects the keys that exist.

``trainer`` is a discriminated union on ``trainer.backend``: :class:`TorchTrainerConfig` (``torch``) and
:class:`MegatronTrainerConfig` (``megatron``: its parallel layout, ``trainer.megatron``). The checks of a recipe
against what the backends need (the megatron layout against the model, megatron-core installed) belong to the
backend registry (:mod:`relax_hpc.trainer.checks`); this module imports no trainer code and no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Union

from pydantic import Field, field_validator, model_validator

from relax_hpc.config.base import Section, Variants


class MegatronConfig(Section):
    """Parallel layout of the ``megatron`` trainer backend (data-parallel size implied: ``num_ranks / (tp * pp)``)."""

    tp: int = Field(1, ge=1)
    """Tensor-parallel size: must divide the attention heads, the key/value heads and the MLP intermediate size (the
    vocabulary is padded to a multiple of ``vocab_multiple * tp``)."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel size: must divide the number of layers (each stage holds an equal share)."""
    distributed_optimizer: bool = True
    """megatron-core's distributed optimizer: the AdamW state and the float32 main weights sharded over the
    data-parallel ranks (gradients reduce-scattered, weights all-gathered), and checkpoints in megatron's
    ``dist_checkpointing`` format possible besides the project's. ``false``: torch's AdamW over the DDP float32
    gradients, its state replicated on every data-parallel rank."""
    vocab_multiple: int = Field(128, ge=1)
    """The vocabulary is padded with zero rows to a multiple of ``vocab_multiple * tp`` (dropped again in HF
    weights)."""
    checkpoint_format: Literal["auto", "dist", "full"] = "auto"
    """The run's checkpoints. ``dist``: megatron's ``dist_checkpointing`` (every rank writes its own shards of the
    model and of the distributed optimizer's state, nothing is gathered to one host; loads at another data-parallel
    size, but only with the same ``tp``, ``pp`` and backend); needs ``distributed_optimizer``. ``full``: the project's
    format (the whole model and optimizer state under HF names, gathered to rank 0; loads in either backend at any
    layout). ``auto``: ``dist`` with the distributed optimizer, else ``full``. Either format resumes a checkpoint of
    the other where it can: a ``dist`` one with this backend, the distributed optimizer and its ``tp``/``pp``."""

    @model_validator(mode="after")
    def _dist_needs_the_distributed_optimizer(self) -> MegatronConfig:
        if self.checkpoint_format == "dist" and not self.distributed_optimizer:
            raise ValueError("checkpoint_format: dist needs the distributed optimizer (it holds the sharded state); "
                             "set distributed_optimizer: true, or checkpoint_format: full")
        return self


class TrainerBase(Section):
    """The learner. The keys below hold for every backend; ``megatron`` has its parallel layout besides
    (``trainer.backend`` selects the variant: the other backend's keys are errors)."""

    backend: Literal["torch", "megatron"] = "torch"
    """``torch`` (HF model, FSDP2 over ranks) or ``megatron`` (megatron-core ``GPTModel``: tensor x pipeline x data
    parallelism; runs on the CPU over gloo too; needs the ``megatron`` extra)."""
    num_ranks: int = Field(1, ge=1)
    """Data-parallel trainer ranks (FSDP2 ``fully_shard`` when > 1; gloo on CPU, NCCL on GPU)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer runs. ``cuda`` on a machine without a GPU is an error."""
    lr: float = Field(1e-6, gt=0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    grad_clip: float = Field(1.0, gt=0)
    """Clip the global gradient norm to this."""
    warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up steps."""
    micro_batch_tokens: int = Field(4096, ge=16)
    """Token budget of one packed micro-batch (sequences are packed without padding up to this many tokens)."""
    checkpoint_every: int = Field(50, ge=1)
    """Checkpoint every N steps (and always on SIGTERM/SIGUSR2 and at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many checkpoints to keep."""
    checkpoint_timeout_s: float = Field(1800.0, gt=0)
    """How long the leader waits for every rank's part of a sharded checkpoint (``trainer.megatron.checkpoint_format:
    dist``) before it fails the save; the previous checkpoint stays the latest."""
    async_checkpoint: bool = False
    """Write periodic checkpoints on a background thread: the step only takes a CPU copy of the weights, optimizer
    state and RNG (that much extra host memory while the write runs); the store position is committed once the
    checkpoint is durable. Checkpoints on a signal or at the end are always written before the role exits. Applies to
    the gathered format; megatron's ``dist`` checkpoints are written in the loop (every rank its own shards)."""
    export_final: bool = True
    """Export the final model in HF format to ``RUN_DIR/export``."""
    fused_head: bool = False
    """On a GPU, compile the chunked LM head's per-chunk elementwise work (log-sum-exp, gather, the softmax gradient)
    into fused kernels with ``torch.compile`` instead of ~8 passes over ``[chunk, vocabulary]`` float32 tensors; the
    first micro-batches pay the compilation, and a compile failure falls back to the eager chunks with one warning.
    Ignored on the CPU. Opt-in (compilation costs the first steps); measured with ``compile_layers`` in
    docs/benchmarks.md ("Real model shapes on one GPU")."""
    compile_layers: bool = False
    """On a GPU, ``torch.compile`` the model's decoder layers for the training forward and backward (fuses each
    layer's small elementwise kernels: RoPE, SiLU x up, residual adds, casts). Generation, checkpoints and exports keep
    the eager layers. The first micro-batches pay the compilation; a compile failure falls back to the eager layers
    with one warning. Ignored on the CPU."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/inf loss or gradient norm: ``stop`` the run with an alert (it ends failed, not completed), or ``skip``
    the update, count it (``train/nonfinite_skipped``) and alert once."""
    max_nonfinite_skips: int = Field(10, ge=0)
    """With ``on_nonfinite: skip``: more non-finite steps than this in a row stop the run."""

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"AdamW betas must each be in [0, 1), got {list(v)}")
        return v


class TorchTrainerConfig(TrainerBase):
    """``trainer.backend: torch``: the HF model, FSDP2 over the ranks."""

    backend: Literal["torch"] = "torch"
    """The torch backend."""


class MegatronTrainerConfig(TrainerBase):
    """``trainer.backend: megatron``: megatron-core's ``GPTModel`` in tensor x pipeline x data parallelism."""

    backend: Literal["megatron"] = "megatron"
    """The megatron backend."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Parallel layout of ``backend: megatron``; with it, ``num_ranks`` counts every trainer process (data x tensor
    x pipeline)."""


TRAINER_VARIANTS = Variants("backend", {"torch": TorchTrainerConfig, "megatron": MegatronTrainerConfig},
                            default="torch")
"""``trainer`` by ``trainer.backend``."""

if TYPE_CHECKING:
    TrainerConfig = Union[TorchTrainerConfig, MegatronTrainerConfig]  # noqa: UP007
else:
    TrainerConfig = TRAINER_VARIANTS.annotation()
"""The ``trainer`` section: one of its backend variants."""
