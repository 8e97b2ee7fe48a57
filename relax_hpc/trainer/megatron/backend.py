"""The ``megatron`` trainer backend: megatron-core's ``GPTModel`` (local layer spec) with tensor, pipeline and data
parallelism.

The model is built from the HF config (:func:`relax_hpc.trainer.megatron.config.model_args`: Qwen3 with QK-norm,
Qwen2/2.5 with QKV biases, GQA, tied or untied embeddings) and its weights come from the HF model through
:mod:`relax_hpc.trainer.megatron.mapping` (this rank's tensor-parallel shard of its pipeline stage's layers).
Micro-batches are packed sequences in one row, their boundaries and positions given to the attention and RoPE by a
:class:`~relax_hpc.trainer.megatron.layers.Packing` (:class:`~relax_hpc.trainer.megatron.layers.PackedCoreAttention`;
``trainer.compile_layers`` compiles megatron's layers around it); log-probs and entropies are computed
from the vocabulary-parallel logits (:func:`~relax_hpc.trainer.megatron.layers.vocab_parallel_logprobs`), then the
algorithm's loss is the torch backend's code path (this class extends
:class:`~relax_hpc.trainer.torch_trainer.TorchBackend`: packing, old/reference log-probs, deferred normalisers,
metrics). Gradients live in megatron's ``DistributedDataParallel`` buffers (float32) and are summed over the
data-parallel replicas by ``finalize_model_grads`` (which also sums the QK-norm gradients over TP); the step divides
them by the global normaliser (tokens or sequences of every micro-batch of every data-parallel replica), clips by
the norm over the unique parameters (all-reduced over TP and the pipeline stages), and steps AdamW.

With ``trainer.megatron.pp > 1`` (:mod:`relax_hpc.trainer.megatron.pipeline`) each rank builds its stage's part of the
GPT (the embedding on the first stage, the final norm and output layer on the last; a tied model's last stage holds a
copy of the embedding, whose gradient megatron's ``finalize_model_grads`` sums with the first stage's). The torch
backend's loop hands its micro-batches to two hooks: :meth:`MegatronBackend._backward` runs them through the 1F1B
schedule of one ``accumulate`` (the loss, and the algorithm's inputs kept for the metrics, exist on the last stage
only) and :meth:`MegatronBackend._policy_logprobs` runs the old/proximal log-probs forward-only through the stages; a
reference or teacher model runs on the last stage only. The step's sums and metrics are broadcast from the last stage
over the pipeline group, so every rank returns the same metrics.

Choices forced by megatron-core 0.16.1 (the newest for Python 3.11), each to revisit on the GPU:

- Optimizer: with ``trainer.megatron.distributed_optimizer`` (the default), megatron's distributed optimizer
  (:mod:`relax_hpc.trainer.megatron.optim`): AdamW state and float32 main weights sharded over the data-parallel
  ranks, gradients reduce-scattered, weights all-gathered; on a machine without CUDA through a shim of
  megatron's CUDA-only tensor factories (``optim.cpu_optimizer_shim``). Without it, ``torch.optim.AdamW`` over the
  DDP float32 gradient buffers, its state replicated over the data-parallel replicas; also where CUDA tensors go
  over gloo groups (TP ranks sharing one GPU), with a warning: the distributed optimizer crashed there.
- Dtypes: every parameter in the model dtype (the local spec's ``torch.nn.RMSNorm`` weights are made in float32
  whatever ``params_dtype`` says; cast, as HF's bfloat16 model and megatron's ``Float16Module`` have them). The
  distributed optimizer needs it: with float32 norms beside bfloat16 weights in one param group, megatron's
  parameter-to-state index map points at the wrong main weights (its optimizer groups list the float32 shards
  first), and its checkpoints and ours read the wrong tensors.
- Pipeline schedule: megatron's own (``pipeline_parallel/schedules.py``) makes its buffers on ``"cuda"`` and does
  not run without CUDA; the backend has its own 1F1B over ``batch_isend_irecv`` (the ``pipeline`` module; no
  interleaved stages). Building a tied model's last stage moves its embedding copy to CUDA; on a machine without
  CUDA ``Tensor.cuda`` is the identity while the GPT is built (``pipeline.cuda_is_cpu``).
- Checkpoints: with the distributed optimizer, by default megatron's ``dist_checkpointing`` format
  (:meth:`MegatronBackend.save_dist_checkpoint` / :meth:`~MegatronBackend.load_dist_checkpoint`: every rank its
  own shards; loads at another DP size, not another TP/PP size), which the run loop takes through
  :meth:`MegatronBackend.sharded_checkpoint` (:mod:`relax_hpc.trainer.megatron.dist_checkpoint`). Otherwise
  (``trainer.megatron.checkpoint_format: full``, or no distributed optimizer) the project's format
  (``relax_hpc.trainer.checkpoint``): the whole model and the AdamW moments under HF names (gathered over TP through
  the weight mapping, and over DP from the distributed optimizer's ranges; with bfloat16 weights the float32 main
  weights too, as the moment ``main_param``), so a checkpoint resumes at any TP/DP size and in either backend.
- Recompute: ``model.gradient_checkpointing`` recomputes every transformer layer in the backward pass (megatron's
  ``recompute_granularity="full"``, ``recompute_method="uniform"``, one layer per checkpoint).

Weights leave under HF names: the TP shards are all-gathered layer by layer and regrouped by the mapping
(:meth:`MegatronBackend.state_buckets` streams them a layer at a time); a later pipeline stage sends each of its
layers on to the first stage as it is made; data-parallel replica 0's TP rank 0 of the first stage (global rank 0)
gets them. Loading the project's checkpoint (whole HF-named tensors on every rank) gives each stage its shard, so a
checkpoint made at one TP/PP/DP layout resumes at another.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.errors import UserError
from relax_hpc.trainer.batch import MicroBatch, TrainItem
from relax_hpc.trainer.megatron.mapping import (
    EMBED,
    FINAL_NORM,
    HF_EMBED,
    HF_HEAD,
    OUTPUT,
    ModelShape,
    hf_to_megatron,
    layer_stage,
    megatron_stage_to_hf,
    stage_layers,
)
from relax_hpc.trainer.torch_trainer import TorchBackend, check_one_normaliser, compiled_layers

log = logging.getLogger(__name__)

_LAYER = "decoder.layers."


def build(cfg: RecipeConfig, *, rank: int, world_size: int, device: str, dtype: Any, algorithm: Any, tokenizer: Any,
          model: Any = None, ref_model: Any = None, teacher: Any = None) -> MegatronBackend:
    """The factory entry of :func:`relax_hpc.trainer.backend.make_backend` for ``trainer.backend: megatron``.
    ``model``: the HF policy whose weights (and config) the megatron model starts from (loaded if None)."""
    from relax_hpc.trainer.megatron.config import require_megatron_core

    require_megatron_core()
    if model is None:
        from relax_hpc.models.load import load_model

        model = load_model(cfg.model, tokenizer, device="cpu", dtype=dtype, seed=cfg.seed)
    return MegatronBackend(cfg, model, rank=rank, world_size=world_size, device=device, dtype=dtype,
                           algorithm=algorithm, ref_model=ref_model, teacher=teacher)


def init_parallel(tp: int, pp: int, device: str = "cpu") -> None:
    """torch.distributed's default group (one in-process rank when there is none: gloo, and NCCL for CUDA tensors
    on a GPU) and megatron's parallel state for ``tp`` x ``pp`` (made again when another layout was set up in this
    process)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from relax_hpc.trainer.megatron.layers import cpu_shim

    cpu_shim()
    quiet_megatron()
    if not dist.is_initialized():
        import atexit

        backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        atexit.register(_destroy_parallel)  # ours: torn down before the interpreter's exit, not by C++ destructors
    if ps.model_parallel_is_initialized():
        if (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) == (tp, pp):
            return
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def _destroy_parallel() -> None:
    """megatron's parallel state and the in-process default group that :func:`init_parallel` made, if still
    there (an exiting process that left them to the C++ destructors aborted now and then under load with
    "terminate called without an active exception")."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _mark_parallel(gpt: Any) -> None:
    """The tensor-parallel attributes megatron sets only when it initialises weights (``perform_initialization``;
    here the weights come from HF): column-parallel and vocabulary-parallel weights split along rows, row-parallel
    along columns, everything else replicated. The gradient norm counts each shard once by them."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_defaults_if_not_set_tensor_model_parallel_attributes,
        set_tensor_model_parallel_attributes,
    )

    for module in gpt.modules():
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            set_tensor_model_parallel_attributes(weight, True, 0, 1)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)
    for p in gpt.parameters():
        set_defaults_if_not_set_tensor_model_parallel_attributes(p)


def quiet_megatron() -> None:
    """megatron-core's INFO records (every DDP bucket's parameter names) and its warnings that TransformerEngine and
    apex are missing (the local spec needs neither) stay out of the role logs; set its logger's level to see them."""
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex)( and Apex)? (is|are) not installed")
    mlog = logging.getLogger("megatron.core")
    if mlog.level == logging.NOTSET:
        mlog.setLevel(logging.WARNING)
    for name, text in _ADVISORIES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.text == text for f in logger.filters):
            logger.addFilter(_DropMessage(text))


_ADVISORIES = (
    # megatron-core >= 0.19: DDP computes the distributed optimizer's buffer layout itself when not given one
    # (DistributedOptimizer.compute_full_param_layout with DDP's own bucket size and groups: the same layout).
    ("megatron.core.distributed.distributed_data_parallel", "full_param_layout not provided"),
    # megatron-core >= 0.19 marks GPTModel deprecated for HybridModel; GPTModel still works and 0.16.1 has no other.
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
)


class _DropMessage(logging.Filter):
    """Drops the records of one logger whose message contains ``text`` (advisories for megatron's own callers)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


class MegatronBackend(TorchBackend):
    """megatron-core GPT trained with TP x PP x DP (module docstring); the loss path is :class:`TorchBackend`'s."""

    def __init__(self, cfg: RecipeConfig, hf_model: Any, *, rank: int, world_size: int, device: str, dtype: Any,
                 algorithm: Any, ref_model: Any = None, teacher: Any = None):
        import torch
        from megatron.core import parallel_state as ps

        from relax_hpc.trainer.megatron.pipeline import Stage

        mc = cfg.trainer.megatron
        if not device.startswith("cuda") and torch.cuda.is_available():
            raise UserError("trainer.device: cpu with trainer.backend: megatron on a machine with a GPU: "
                            "megatron-core puts parts of the model (RoPE) on the current CUDA device; use "
                            "trainer.device: cuda, or hide the GPUs (CUDA_VISIBLE_DEVICES=)")
        if world_size % (mc.tp * mc.pp):
            raise UserError(f"{world_size} trainer processes are not a multiple of tp*pp={mc.tp * mc.pp}")
        init_parallel(mc.tp, mc.pp, device)
        self.cfg, self.device, self.dtype, self.algorithm = cfg, device, dtype, algorithm
        self.rank, self.world_size = rank, world_size
        self.lora = False  # model.lora is refused for this backend (config/model.py)
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.tp_rank, self.tp_size = ps.get_tensor_model_parallel_rank(), mc.tp
        self.tp_group, self.dp_group = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
        self.stage = Stage.of_this_rank(device)  # this rank's pipeline stage
        self.ref_model, self.teacher = ref_model, teacher
        self.dist_opt = mc.distributed_optimizer and not self._dist_opt_on_gloo_cuda()
        temp = cfg.rollout.sampling.temperature
        self.temperature = temp if temp > 0 else 1.0
        self._hf_config = hf_model.config
        self._gen_config = getattr(hf_model, "generation_config", None)
        self.shape = ModelShape.from_hf(self._hf_config.to_dict())
        self.gpt, self.model = self._build_model(hf_model, torch.device(device))
        self.params = dict(self.gpt.named_parameters())
        t = cfg.trainer
        if self.dist_opt:
            from relax_hpc.trainer.megatron.optim import build_distributed_optimizer

            self.optimizer = build_distributed_optimizer(t, self.model, dtype)
        else:
            self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=t.lr, betas=tuple(t.betas),
                                               weight_decay=t.weight_decay, foreach=False)
        self.compiled_ctx = compiled_layers(self.gpt, cfg, device)  # megatron's TransformerLayers, as HF's
        if rank == 0:
            log.info("megatron backend: tp=%d pp=%d dp=%d, %s on %s, %s", mc.tp, mc.pp, self.dp_size,
                     str(dtype).removeprefix("torch."), device,
                     "megatron's distributed optimizer" if self.dist_opt else "torch's AdamW")
        self.step = 0
        self._keys: list[str] | None = None
        self.begin_step()

    def _dist_opt_on_gloo_cuda(self) -> bool:
        """Whether this rank's CUDA tensors go over gloo groups (TP ranks sharing one GPU: NCCL refuses two ranks
        on one device), with one warning that megatron's distributed optimizer is off there: over gloo with CUDA
        tensors it crashed both ranks (SIGSEGV right after megatron's DDP was built, megatron-core 0.19.2 on an
        H200), and that layout has one data-parallel replica (gloo has no coalesced all-reduce of CUDA gradient
        buffers), so it would shard nothing."""
        import torch.distributed as dist

        gloo = self.device.startswith("cuda") and any(dist.get_backend(g) == "gloo"
                                                      for g in (self.dp_group, self.tp_group))
        if gloo and self.rank == 0:
            log.warning("trainer.megatron.distributed_optimizer is off for this run: the ranks' groups are gloo with "
                        "CUDA tensors (ranks sharing a GPU), where megatron's distributed optimizer crashes; torch's "
                        "AdamW instead (one data-parallel replica: nothing to shard); no dist_checkpointing")
        return gloo

    def _build_model(self, hf_model: Any, device: Any) -> tuple[Any, Any]:
        """(GPTModel, its DDP wrapper), the GPT holding this rank's shard of ``hf_model``'s weights."""
        import torch
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        from relax_hpc.trainer.megatron.config import ddp_args, model_args
        from relax_hpc.trainer.megatron.layers import PackedCoreAttention, Packing, position_rope
        from relax_hpc.trainer.megatron.pipeline import cuda_is_cpu

        mc = self.cfg.trainer.megatron
        args = model_args(self._hf_config.to_dict(), tp=mc.tp, pp=mc.pp, pp_rank=self.stage.rank,
                          vocab_multiple=mc.vocab_multiple, recompute=self.cfg.model.gradient_checkpointing)
        tc = TransformerConfig(**args.transformer, activation_func=getattr(torch.nn.functional, args.activation),
                               use_cpu_initialization=True, perform_initialization=False,
                               params_dtype=self.dtype, bf16=self.dtype == torch.bfloat16, pipeline_dtype=self.dtype)
        spec = get_gpt_layer_local_spec(qk_layernorm=args.transformer["qk_layernorm"], normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
        with cuda_is_cpu():  # a last stage's copy of tied embeddings is moved to CUDA (pipeline.py)
            gpt = GPTModel(tc, spec, **args.gpt)
        _mark_parallel(gpt)
        self.packing = Packing()
        position_rope(gpt.rotary_pos_emb, self.packing)
        for module in gpt.modules():
            if isinstance(module, PackedCoreAttention):
                module.packing = self.packing
        shard = hf_to_megatron(hf_model.state_dict(), self.shape, tp=mc.tp, tp_rank=self.tp_rank, pp=mc.pp,
                               pp_rank=self.stage.rank, vocab_multiple=mc.vocab_multiple)
        missing, unexpected = gpt.load_state_dict(shard, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        assert not missing and not unexpected, (missing, unexpected)
        with torch.no_grad():  # the local spec's norms are torch.nn.RMSNorm, made in float32 whatever params_dtype
            for p in gpt.parameters():  # says: all in the model dtype, as HF's model and megatron's Float16Module
                if p.is_floating_point() and p.dtype != self.dtype:
                    p.data = p.data.to(self.dtype)
        gpt.to(device)
        ddp = DistributedDataParallel(tc, DistributedDataParallelConfig(**ddp_args(self.cfg.trainer,
                                                                                   dist_opt=self.dist_opt)), gpt)
        return gpt, ddp.train()

    # ------------------------------------------------------------------ forward
    def sequence_logprobs(self, model: Any, mb: MicroBatch, *, with_entropy: bool = False) -> tuple[Any, Any]:
        """Log-probs [T] (and entropies [T]) of ``mb``'s response tokens: the megatron model's from its
        vocabulary-parallel logits; a reference/teacher HF model's as the torch backend computes them."""
        if model is not self.model:
            return super().sequence_logprobs(model, mb, with_entropy=with_entropy)
        from relax_hpc.trainer.logprobs import chunked_logprobs
        from relax_hpc.trainer.megatron.layers import vocab_parallel_logprobs

        if self.tp_size == 1:  # the torch backend's chunked head: no [tokens, vocabulary] logits kept for backward
            hidden = self._forward(mb, hidden=True)
            weight = self._output_weight()[: self.shape.vocab_size]  # the padded rows are not in the vocabulary
            return chunked_logprobs(hidden, weight, mb.targets, temperature=self.temperature,
                                    with_entropy=with_entropy, fused=None if self.cfg.trainer.fused_head else False)
        logits = self._forward(mb).float() / self.temperature
        return vocab_parallel_logprobs(logits, mb.targets, vocab_size=self.shape.vocab_size, tp_rank=self.tp_rank,
                                       tp_group=self.tp_group, with_entropy=with_entropy)

    def _output_weight(self) -> Any:
        """The output layer's weight [V_padded / tp, H] (the embedding's when they are tied)."""
        gpt = self.gpt
        return gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
            else gpt.output_layer.weight

    def _forward(self, mb: MicroBatch, *, hidden: bool = False) -> Any:
        """This TP rank's logits [T, V / tp] predicting each response token of ``mb`` (one packed row), or with
        ``hidden`` the final (normed) hidden states [T, H] at those positions: the GPT stops before its output
        layer (megatron's ``post_process`` off for the call). The sequences' boundaries are the GPT's
        ``attention_mask`` and its RoPE reads their positions (:attr:`packing`); to megatron the row is one
        sequence."""
        if mb.input_ids.shape[0] != 1 or mb.model_kwargs:
            raise UserError("the megatron backend trains text-only micro-batches packed in one row")
        self.gpt.post_process = not hidden
        try:
            with self.packing.use([it.num_tokens for it in mb.items], mb.position_ids[0]) as cu:
                out = self.model(input_ids=mb.input_ids, position_ids=mb.position_ids, attention_mask=cu)
        finally:  # [1, tokens, V / tp], or hidden states [tokens, 1, H]
            self.gpt.post_process = True
        return out[:, 0][mb.logit_index] if hidden else out[0, mb.logit_index]

    def logits(self, input_ids: Any) -> Any:
        """Full-vocabulary logits [B, S, V] of unpacked ``input_ids`` [B, S] (tests and checks; every TP rank
        calls, all get them)."""
        import torch

        if self.stage.size > 1:  # through the stages, from the last to every rank
            from relax_hpc.trainer.megatron.pipeline import logits

            return logits(self, input_ids)
        rows = []
        with torch.no_grad():
            for row in input_ids:
                pos = torch.arange(row.numel(), device=row.device)[None]
                out = self.model(input_ids=row[None], position_ids=pos, attention_mask=None)[0]
                rows.append(self.gather_vocab(out)[:, : self.shape.vocab_size])
        return torch.stack(rows)

    def gather_vocab(self, t: Any) -> Any:
        import torch
        import torch.distributed as dist

        if self.tp_size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def _use_rows(self, items: list[TrainItem]) -> bool:
        return False  # one THD row per micro-batch: attention stays within each sequence by cu_seqlens

    # ------------------------------------------------------------------ train
    def begin_step(self) -> None:
        self._zero_grads()
        super().begin_step()

    def finish_step(self) -> dict[str, float]:
        """Sum gradients over DP (megatron's ``finalize_model_grads``), divide by the global normaliser, clip by
        the global norm, step AdamW; the step's metrics (the same on every rank)."""
        t0 = time.perf_counter()
        n = self._all_reduce({"tok": self._n_tok, "seq": self._n_seq, "items": float(self._n_items),
                              "loss": self._unit_loss()})
        divisor = max(n["tok"] if self.cfg.algorithm.loss_agg == "token_mean" else n["seq"], 1.0)
        lr = self._lr()
        for g in self.optimizer.param_groups:  # megatron's optimizer: every group of every chained optimizer
            g["lr"] = lr
        grad_norm = self._apply_gradient(self.optimizer, divisor)
        self.step += 1
        metrics = self._step_metrics(n["tok"], n["seq"])
        check_one_normaliser(self.algorithm, metrics["train/loss"], n["loss"] / divisor)
        metrics.update({"train/grad_norm": grad_norm, "train/lr": lr, "train/num_micro_batches": float(self._n_mb),
                        "train/tokens": float(self._tokens),
                        "train/padding_fraction": 1.0 - self._tokens / self._slots if self._slots else 0.0,
                        "perf/train_time": self._compute + time.perf_counter() - t0, "train/samples": n["items"]})
        self._inputs = []
        return metrics

    def _apply_gradient(self, optimizer: Any, divisor: float) -> float:
        """The accumulated gradient summed over DP replicas (and the QK-norm parts over TP: megatron's
        ``finalize_model_grads``), divided by ``divisor``, clipped; ``optimizer`` steps unless its norm is not
        finite; the gradients zeroed. Returns the gradient norm before clipping."""
        self._finalize_grads()  # with the distributed optimizer, each rank's ranges are reduce-scattered
        for p in self.params.values():  # DDP sums over replicas (calculate_per_token_loss)
            g = p.main_grad.mul_(1.0 / divisor)
            if optimizer is not self.optimizer or not self.dist_opt:
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)  # bf16 weights: AdamW on them, as torch's
        if self.dist_opt and optimizer is self.optimizer:
            from relax_hpc.trainer.megatron.optim import step

            grad_norm = step(optimizer, self.cfg.trainer.grad_clip)
        else:
            grad_norm = self._clip_grad_norm(self.cfg.trainer.grad_clip)
            if math.isfinite(grad_norm):
                optimizer.step()
        if not math.isfinite(grad_norm):
            log.warning("non-finite gradient norm at step %d: update skipped", self.step)
        self._zero_grads()
        return grad_norm

    def _finalize_grads(self) -> None:
        """megatron's ``finalize_model_grads``: the gradients summed over DP replicas, the replicated parts (QK-norm)
        over TP. A single replica skips the DP part (there is nothing to sum) where megatron's sync cannot run:
        on the CPU (megatron-core >= 0.19 asks for the current CUDA stream there), and where the group is gloo on
        CUDA tensors (TP ranks sharing one GPU: gloo has no coalesced all-reduce of CUDA tensors)."""
        import torch.distributed as dist
        from megatron.core.distributed import finalize_model_grads

        gloo_cuda = self.device.startswith("cuda") and dist.get_backend(self.dp_group) == "gloo"
        skip = self.dp_size == 1 and (not self.device.startswith("cuda") or gloo_cuda)
        if skip:
            self.model.finish_grad_sync = lambda *args, **kwargs: None  # this instance only, undone below
        try:
            finalize_model_grads([self.model])
        finally:
            if skip:
                del self.model.finish_grad_sync

    def _zero_grads(self) -> None:
        """Gradients zeroed (the DDP float32 buffers, which ``.grad`` views during a step)."""
        self.model.zero_grad_buffer()
        for p in self.params.values():
            p.grad = None
        if self.dist_opt and hasattr(self, "optimizer"):
            self.optimizer.zero_grad()  # the main weights' .grad (views of the buffers' ranges)

    def _clip_grad_norm(self, max_norm: float) -> float:
        """The L2 norm of the whole model's gradient (each TP-sharded parameter's shards once, a replicated one
        once, over every pipeline stage, a last stage's copy of tied embeddings not counted) and
        ``torch.nn.utils.clip_grad_norm_``'s scaling by ``max_norm / (norm + 1e-6)`` when above 1."""
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        mine = [p.grad for p in self.params.values()
                if param_is_not_tensor_parallel_duplicate(p) and param_is_not_shared(p)]
        sq = torch.stack([g.double().pow(2).sum() for g in mine]).sum().cpu()
        if self.tp_size * self.stage.size > 1:
            dist.all_reduce(sq, group=ps.get_model_parallel_group())
        norm = float(sq.sqrt())
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in self.params.values():
                p.grad.mul_(coef)
        return norm

    def _all_reduce(self, d: dict[str, float]) -> dict[str, float]:
        """``d`` summed over the data-parallel replicas (TP ranks of a replica hold the same values), as the last
        pipeline stage has it (the losses and metrics exist there; counts are the same on every stage)."""
        import torch
        import torch.distributed as dist

        if self.dp_size == 1 and self.stage.size == 1:
            return d
        keys = sorted(d)
        t = torch.tensor([d[k] for k in keys], dtype=torch.float64)
        if self.dp_size > 1:
            dist.all_reduce(t, group=self.dp_group)
        t = self.stage.from_last(t, "the step's sums from the last stage")
        return dict(zip(keys, t.tolist(), strict=True))

    def sft_warmup(self, prompts: Any, tokenizer: Any, *, steps: int, lr: float, batch_size: int,
                   max_tokens: int) -> dict[str, float]:
        """``steps`` supervised updates (the torch backend's: mean token cross-entropy on the answers, AdamW of
        its own, gradient clipping) on pairs from ``prompts``; every data-parallel replica draws its own pairs."""
        import numpy as np
        import torch

        from relax_hpc.trainer.batch import pack
        from relax_hpc.trainer.sft import answer_ids

        if steps <= 0:
            return {}
        if self.dist_opt:  # the RL optimizer with torch's AdamW defaults for the warm-up, fresh state afterwards
            opt = self.optimizer
            saved = [{k: g[k] for k in ("lr", "betas", "weight_decay")} for g in opt.param_groups]
            for g in opt.param_groups:
                g.update(lr=lr, betas=(0.9, 0.999), weight_decay=0.01)
        else:
            opt = torch.optim.AdamW(list(self.params.values()), lr=lr, foreach=False)
        t0, temperature, loss = time.perf_counter(), self.temperature, float("nan")
        self.temperature = 1.0
        try:
            for _ in range(steps):
                batch = prompts.next_batch(batch_size)
                answers = [np.asarray(answer_ids(tokenizer, p.answer)) for p in batch]
                items = [TrainItem.of(prompt_ids=np.asarray(p.prompt_ids), response_ids=a,
                                   logprobs=np.zeros(len(a), np.float32), loss_mask=np.ones(len(a), np.float32))
                         for p, a in zip(batch, answers, strict=True)]
                n_tok = self._all_reduce({"tok": float(sum(len(a) for a in answers))})["tok"]
                total = self._sft_backward(pack(items, max_tokens, device=self.device, rows=False))
                self._apply_gradient(opt, max(n_tok, 1.0))
                loss = self._all_reduce({"loss": total})["loss"] / max(n_tok, 1.0)
        finally:
            self.temperature = temperature
            if self.dist_opt:
                from relax_hpc.trainer.megatron.optim import reset_state

                for g, hp in zip(opt.param_groups, saved, strict=True):
                    g.update(hp)
                reset_state(opt)
        return {"warmup/loss": loss, "warmup/steps": float(steps), "warmup/seconds": time.perf_counter() - t0}

    def _sft_backward(self, mbs: list[MicroBatch]) -> float:
        """Forward and backward of the summed answer cross-entropy of ``mbs``; the sum (on the last stage)."""
        parts: list[float] = []

        def loss_of(k: int, mb: MicroBatch) -> Any:
            part = -(self.sequence_logprobs(self.model, mb)[0] * mb.loss_mask).sum()
            parts.append(float(part.detach()))
            return part

        self._backward(mbs, loss_of)
        return sum(parts)

    # ------------------------------------------------------------------ pipeline stages
    def _backward(self, mbs: list[MicroBatch], loss_of: Any) -> None:
        """With pipeline stages, the micro-batches through the 1F1B schedule (``loss_of`` runs on the last stage)."""
        if self.stage.size == 1:
            super()._backward(mbs, loss_of)
            return
        from relax_hpc.trainer.megatron.pipeline import train

        train(self, mbs, loss_of)

    def _policy_logprobs(self, mbs: list[MicroBatch]) -> list[Any]:
        """With pipeline stages, forward through them: the log-probs on the last stage, None on the others."""
        if self.stage.size == 1:
            return super()._policy_logprobs(mbs)
        from relax_hpc.trainer.megatron.pipeline import forward_logprobs

        return [None if r is None else r[0] for r in forward_logprobs(self, mbs)]

    def _aux_logprobs(self, model: Any, mbs: list[MicroBatch]) -> list[Any]:
        """A reference/teacher model's log-probs, where the loss is computed (the last pipeline stage)."""
        return super()._aux_logprobs(model, mbs) if self.stage.last else [None] * len(mbs)

    # ------------------------------------------------------------------ weights out
    def _units(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """This rank's parameters per unit of the HF layout (:meth:`_units_of`)."""
        return self._units_of({n: p.detach() for n, p in self.params.items()})

    def _hf_units(self, units: Iterator[tuple[int, dict[str, Any]]], *,
                  weights: bool = True) -> Iterator[dict[str, Any]]:
        """Each unit's tensors under HF names (TP shards all-gathered within each replica's TP group, regrouped by
        the mapping; a pipeline stage's units sent on to the first stage a unit at a time). Global rank 0 gets them,
        the other ranks of replica 0 empty dicts, other replicas nothing; with :attr:`state_on_every_rank`
        (colocate) every rank gets them. ``weights``: a tied model's ``lm_head.weight`` is there too, the embedding
        tensor itself (as in the HF model's ``state_dict()``, which strict loaders expect)."""
        every = self.state_on_every_rank
        if self.dp_rank != 0 and not every:
            for _ in units:  # made anyway: the distributed optimizer's moments are all-reduced over DP per unit
                pass
            return
        mine = iter(units)
        for i in range(self.shape.num_layers):
            owner = layer_stage(self.shape, self.stage.size, i)
            part: dict[str, Any] = {}
            if owner == self.stage.rank:
                j, unit = next(mine)
                assert j == i, (j, i)
                part = self._gathered(unit, i, convert=every or self.tp_rank == 0)
            part = self.stage.hand_over(part, owner, every=every, to_first=self.tp_rank == 0)
            if self.rank != 0 and not every:
                yield {}
                continue
            if weights and self.shape.tied and HF_EMBED in part:
                part[HF_HEAD] = part[HF_EMBED]
            yield part

    def _gathered(self, unit: dict[str, Any], i: int, *, convert: bool) -> dict[str, Any]:
        """Unit ``i`` (this TP rank's shards) under HF names, whole over TP (every TP rank calls: an all-gather per
        tensor); ``{}`` without ``convert``."""
        import torch
        import torch.distributed as dist

        shards: list[dict[str, Any]] = [{} for _ in range(self.tp_size)]
        for name in sorted(unit):
            t = unit[name].cpu().contiguous()
            parts = [t] if self.tp_size == 1 else [torch.empty_like(t) for _ in range(self.tp_size)]
            if self.tp_size > 1:
                dist.all_gather(parts, t, group=self.tp_group)
            for r, part in enumerate(parts):
                shards[r][name] = part
        return megatron_stage_to_hf(shards, self.shape, pp=self.shape.num_layers, pp_rank=i) if convert else {}

    def full_state_dict(self, *, copy: bool = False) -> dict[str, Any]:
        """The whole model under HF names on global rank 0 (every rank with ``state_on_every_rank``); new tensors (the
        mapping regroups the shards), so ``copy`` changes nothing."""
        out: dict[str, Any] = {}
        for part in self._hf_units(self._units()):
            out.update(part)
        return out

    def state_buckets(self, bucket_bytes: int) -> Iterator[dict[str, Any]]:
        """The HF tensors a layer at a time, in buckets of about ``bucket_bytes`` (where :meth:`full_state_dict`
        has them; other ranks of replica 0 empty buckets)."""
        from relax_hpc.trainer.backend import bucketed

        yield from bucketed(((name, t) for part in self._hf_units(self._units()) for name, t in part.items()),
                            bucket_bytes)

    def detached(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return dict(state_dict)  # the HF tensors are made by the mapping, never live parameter storage

    def hf_config(self) -> dict[str, Any]:
        return dict(self._hf_config.to_dict())

    def generation_config(self) -> dict[str, Any] | None:
        return None if self._gen_config is None else dict(self._gen_config.to_dict())

    def generation_model(self) -> Any:
        return None  # an in-process engine builds its own HF model and receives the weights by state dict

    def export_hf(self, path: Path | str, tokenizer: Any) -> None:
        """``save_pretrained``'s folder: sharded safetensors (huggingface_hub), config, generation config and the
        tokenizer; rank 0 writes."""
        from huggingface_hub import save_torch_state_dict

        sd = self.full_state_dict()
        if self.rank != 0:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_torch_state_dict(sd, path, metadata={"format": "pt"})
        self._hf_config.save_pretrained(path)
        if self._gen_config is not None:
            self._gen_config.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model, AdamW state) under HF names, whole tensors on rank 0 (module docstring: any TP/DP resumes). With
        the distributed optimizer the moments are made whole over DP a layer at a time (every rank calls)."""
        model_sd = self.full_state_dict()
        state: dict[str, dict[str, Any]] = {}
        step = self._optimizer_step()
        if step is not None:
            for key in self._moment_keys():
                for part in self._hf_units(self._moment_units(key), weights=False):
                    for name, t in part.items():
                        state.setdefault(name, {})[key] = t
            for st in state.values():
                st["step"] = step.detach().clone()
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": sorted(model_sd)}
                  for g in self.optimizer.param_groups]
        return model_sd, {"state": state, "param_groups": groups}

    def _moment_keys(self) -> tuple[str, ...]:
        """The per-parameter optimizer tensors a checkpoint holds: the Adam moments, and the distributed optimizer's
        float32 main weights where the model's are not float32 (``main_param``)."""
        import torch

        extra = ("main_param",) if self.dist_opt and self.dtype != torch.float32 else ()
        return ("exp_avg", "exp_avg_sq", *extra)

    def _optimizer_step(self) -> Any:
        """AdamW's step counter, or None before the first step (no state yet)."""
        if self.dist_opt:
            from relax_hpc.trainer.megatron.optim import has_state, step_count

            return step_count(self.optimizer) if has_state(self.optimizer) else None
        if not all(self.optimizer.state.get(p) for p in self.params.values()):
            return None
        steps = {float(self.optimizer.state[p]["step"]) for p in self.params.values()}
        assert len(steps) == 1, steps
        return self.optimizer.state[next(iter(self.params.values()))]["step"]

    def _moment_units(self, key: str) -> Iterator[tuple[int, dict[str, Any]]]:
        """Optimizer tensor ``key`` of every parameter of this stage (whole over DP), per unit of the HF layout (layer
        by layer: the distributed optimizer's ranges are all-reduced one unit at a time)."""
        if not self.dist_opt:
            yield from self._units_of({n: self.optimizer.state[p][key] for n, p in self.params.items()})
            return
        from relax_hpc.trainer.megatron.optim import gather_moments

        internal = "param" if key == "main_param" else key
        for i, unit in self._units_of(self.params):
            whole = gather_moments(self.optimizer, self.dp_group, (internal,), params=list(unit.values()))
            yield i, {name: whole[p][internal] for name, p in unit.items()}

    def _units_of(self, tensors: dict[str, Any]) -> Iterator[tuple[int, dict[str, Any]]]:
        """Per-parameter tensors of this pipeline stage (keyed by megatron parameter name, layers under local
        indices) grouped per unit of the HF layout, with the unit's global index: layer 0 (with the embedding), ...,
        the last layer (with the final norm and the output layer), each layer's names under local index 0
        (:func:`megatron_stage_to_hf` with one layer per "stage")."""
        n = self.shape.num_layers
        for local, i in enumerate(stage_layers(self.shape, self.stage.size, self.stage.rank)):
            prefix = f"{_LAYER}{local}."
            unit = {f"{_LAYER}0.{k[len(prefix):]}": v for k, v in tensors.items() if k.startswith(prefix)}
            for name in (EMBED,) if i == 0 else ():
                unit[name] = tensors[name]
            for name in (FINAL_NORM, OUTPUT) if i == n - 1 else ():
                if name in tensors:
                    unit[name] = tensors[name]
            yield i, unit

    def load_checkpoint_state(self, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None) -> None:
        """This rank's shards of a whole HF-named model (and AdamW state) from :meth:`checkpoint_state`; with the
        distributed optimizer, this rank's ranges of the moments (and of the float32 main weights: the
        checkpoint's ``main_param`` where it has them, else the loaded weights)."""
        import torch

        mc = self.cfg.trainer.megatron

        def shard(hf_sd: dict[str, Any]) -> dict[str, Any]:
            return hf_to_megatron(hf_sd, self.shape, tp=mc.tp, tp_rank=self.tp_rank, pp=mc.pp,
                                  pp_rank=self.stage.rank, vocab_multiple=mc.vocab_multiple)

        st = (optim_sd or {}).get("state") or {}
        if self.dist_opt:
            from relax_hpc.trainer.megatron.optim import ensure_state, scatter_moments, sync_main_params

            if st:
                ensure_state(self.optimizer)  # before the weights: it takes one zero-gradient step
        with torch.no_grad():
            for name, t in shard(model_sd).items():
                self.params[name].copy_(t)
        if self.dist_opt:
            sync_main_params(self.optimizer)
        if not st:
            return
        keys = [k for k in ("exp_avg", "exp_avg_sq", "main_param") if k in next(iter(st.values()))]
        moments = {key: shard({name: s[key] for name, s in st.items()}) for key in keys}
        step = next(iter(st.values()))["step"]
        if self.dist_opt:
            tensors = {p: {("param" if k == "main_param" else k): moments[k][name] for k in keys}
                       for name, p in self.params.items()}
            scatter_moments(self.optimizer, tensors, step)
        else:
            for name, p in self.params.items():
                self.optimizer.state[p] = {"step": torch.as_tensor(step, dtype=torch.float32).clone(),
                                           "exp_avg": moments["exp_avg"][name].to(p.device, p.dtype),
                                           "exp_avg_sq": moments["exp_avg_sq"][name].to(p.device, p.dtype)}
        for g, saved in zip(self.optimizer.param_groups, optim_sd.get("param_groups", []), strict=False):
            g.update({k: v for k, v in saved.items() if k != "params"})

    # ------------------------------------------------------------------ megatron's own checkpoints
    def save_dist_checkpoint(self, path: Path | str) -> None:
        """The model and the distributed optimizer in megatron's ``dist_checkpointing`` format (``dp_reshardable``:
        every rank writes its own shards; :meth:`load_dist_checkpoint` reads them at another data-parallel size,
        the same TP size). Every rank calls. Needs ``trainer.megatron.distributed_optimizer``."""
        from relax_hpc.trainer.megatron.optim import save_dist_checkpoint

        self._need_dist_opt("save_dist_checkpoint")
        save_dist_checkpoint(path, self.model, self.optimizer)

    def load_dist_checkpoint(self, path: Path | str) -> None:
        """What :meth:`save_dist_checkpoint` wrote (weights, main weights, moments, step counter). Every rank calls."""
        from relax_hpc.trainer.megatron.optim import load_dist_checkpoint

        self._need_dist_opt("load_dist_checkpoint")
        load_dist_checkpoint(path, self.model, self.optimizer)

    def sharded_checkpoint(self) -> Any:
        """megatron's ``dist_checkpointing`` as the run's checkpoint format (``trainer.megatron.checkpoint_format``;
        :mod:`relax_hpc.trainer.megatron.dist_checkpoint`); None without the distributed optimizer."""
        from relax_hpc.trainer.megatron.dist_checkpoint import sharded_checkpoint

        return sharded_checkpoint(self)

    def _need_dist_opt(self, what: str) -> None:
        if not self.dist_opt:
            why = (" (it is set, but off where the ranks' groups are gloo with CUDA tensors)"
                   if self.cfg.trainer.megatron.distributed_optimizer else "")
            raise UserError(f"{what}: megatron's dist_checkpointing holds the distributed optimizer's state; set "
                            f"trainer.megatron.distributed_optimizer: true{why} (the project's checkpoints work "
                            "either way)")
