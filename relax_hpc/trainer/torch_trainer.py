"""The ``torch`` trainer backend: an HF causal LM, AdamW, packed micro-batches, FSDP2 over ranks.

One step (:meth:`TorchBackend.train_step`, or ``begin_step`` / ``accumulate`` ... / ``finish_step`` when groups
stream in) = one optimizer update over a step's items: they are packed into micro-batches of at most
``trainer.micro_batch_tokens`` tokens (no padding). The step's global normalisers (masked-in tokens and sequences
over all micro-batches and ranks) are known only when its last micro-batch arrived, so each micro-batch's loss is
back-propagated with normaliser 1 and :meth:`TorchBackend.finish_step` divides the summed gradient by the global
normaliser: gradients are linear in that scale, so the update equals one big batch's. The metrics are then computed
by the algorithm from each micro-batch's (detached) loss inputs with the true global normalisers, as the
:class:`~relax_hpc.algorithms.base.LossInputs` contract says, so every metric has its own normaliser (token means
over tokens whatever ``loss_agg`` is).

Stale samples kept by ``store.stale_policy: flag`` are trained against the trainer's own current log-probs (the
proximal policy of decoupled PPO) for those samples: the ratio is clipped around the current policy and the truncated
importance weight ``min(exp(logp_now - logp_rollout), tis_cap)`` corrects for the older policy that sampled them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_hpc.algorithms.mismatch import MismatchMeter, mismatch_metrics, staleness_of
from relax_hpc.config.schema import RecipeConfig
from relax_hpc.trainer.backend import HostCopy, PinnedCopier, TrainerBackend, hf_module_on_one_gpu
from relax_hpc.trainer.batch import DEFAULT_ATTN_SCALE, MicroBatch, TrainItem, pack, response_logits

log = logging.getLogger(__name__)

_LOSS = "train/loss"


def build(cfg: RecipeConfig, *, rank: int, world_size: int, device: str, dtype: Any, algorithm: Any, tokenizer: Any,
          model: Any = None, ref_model: Any = None, teacher: Any = None) -> TorchBackend:
    """The factory entry of :func:`relax_hpc.trainer.backend.make_backend` for ``trainer.backend: torch``."""
    if model is None:
        from relax_hpc.models.load import load_model

        model = load_model(cfg.model, tokenizer, device=device, dtype=dtype, seed=cfg.seed)
    return TorchBackend(cfg, model, device=device, dtype=dtype, algorithm=algorithm, ref_model=ref_model,
                        teacher=teacher, world_size=world_size, rank=rank)


class TorchBackend(TrainerBackend):
    """Owns the model being trained, its optimizer, and (optionally) reference and teacher models."""

    def __init__(self, cfg: RecipeConfig, model: Any, *, device: str, dtype: Any, algorithm: Any,
                 ref_model: Any = None, teacher: Any = None, world_size: int = 1, rank: int = 0):
        import torch

        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.algorithm = algorithm
        self.world_size = world_size
        self.rank = rank
        self.dp_rank, self.dp_size = rank, world_size  # FSDP: every rank is a data-parallel replica
        self.lora = cfg.model.lora is not None
        """Training low-rank adapters (``model.lora``): ``model`` becomes a ``PeftModel`` around the same module."""
        self.base: dict[str, str] | None = None
        """With ``model.lora``: the base model's path and weights' sha256 (named in every adapter snapshot)."""
        hf_module = model
        if cfg.model.lora is not None:
            from relax_hpc.models.lora import apply_lora, base_identity

            self.base = base_identity(model, cfg.model.path)
            model = apply_lora(model, cfg.model.lora)
        self.model = model
        self._trained = {n for n, p in model.named_parameters() if p.requires_grad}
        """The names of the parameters the optimizer updates (with ``model.lora``: the adapters and
        ``modules_to_save``)."""
        if world_size > 1:  # with model.lora the frozen base is sharded too; only the adapters have gradients
            self.model = _fully_shard(model, hf_module)
        self.model.train()
        t = cfg.trainer
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=t.lr,
                                           betas=tuple(t.betas), weight_decay=t.weight_decay,
                                           foreach=True)  # on the CPU too: the same values as the per-tensor loop
        self.ref_model = ref_model
        self.teacher = teacher
        temp = cfg.rollout.sampling.temperature
        self.temperature = temp if temp > 0 else 1.0
        self.step = 0
        self._keys: list[str] | None = None
        self.compiled_ctx = compiled_layers(self.model, cfg, device)
        self._copier: PinnedCopier | None = None
        self.begin_step()

    # ------------------------------------------------------------------ forward
    def sequence_logprobs(self, model: Any, mb: MicroBatch, *, with_entropy: bool = False) -> tuple[Any, Any]:
        """Log-probs of the response tokens [T] (and entropies [T]) under ``model`` at the sampling temperature."""
        import torch

        from relax_hpc.trainer.logprobs import chunked_supported, response_logprobs

        hf = self.generation_model() if model is self.model else model  # a LoRA policy: the module PEFT wraps
        if chunked_supported(hf, mb, world_size=self.world_size):  # no [T, V] logits (trainer/logprobs.py)
            return response_logprobs(hf, mb, temperature=self.temperature, with_entropy=with_entropy,
                                     fused=None if self.cfg.trainer.fused_head else False)
        logits = response_logits(model, mb).float() / self.temperature  # [T, V]
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, mb.targets[:, None])[:, 0]
        ent = None
        if with_entropy:
            ent = -(logp_all.exp() * logp_all).sum(-1)
        return logp, ent

    # ------------------------------------------------------------------ train
    def begin_step(self) -> None:
        """Start a step whose micro-batches may arrive over time (micro-batch streaming)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._inputs: list[Any] = []  # each micro-batch's detached LossInputs: the metrics are computed at the end
        self._n_tok = 0.0
        self._n_seq = 0.0
        self._n_items = 0
        self._unit_losses: list[Any] = []  # each micro-batch's detached loss, summed once at the end
        self._n_mb = 0
        self._tokens = 0
        self._slots = 0
        self._compute = 0.0
        self._mismatch = MismatchMeter(self.cfg.algorithm.tis_cap)  # engine vs trainer log-probs, per step

    def accumulate(self, items: list[TrainItem]) -> None:
        """Forward + backward over ``items`` now (whole groups, advantages set), with normaliser 1: the gradient is
        divided by the step's global normaliser in :meth:`finish_step` (module docstring)."""
        import dataclasses

        from relax_hpc.algorithms.common import count_normalisers

        if not items:
            return
        t0 = time.perf_counter()
        cfg = self.cfg
        hidden = int(getattr(getattr(self.model, "config", None), "hidden_size", 0) or 0)
        from relax_hpc.models.mrope import MRope  # omni-modal: VL/Omni samples pack together (3-D positions)

        mbs = pack(items, cfg.trainer.micro_batch_tokens, device=self.device, rows=self._use_rows(items),
                   attn_scale=6.0 * hidden if hidden else DEFAULT_ATTN_SCALE,
                   pack_multimodal=MRope.of(self.model) is not None)
        with self.compiled_ctx():
            olds = self._old_logprobs(mbs)
        refs = self._aux_logprobs(self.ref_model, mbs) if cfg.algorithm.kl_coef > 0 and self.ref_model else None
        teach = self._aux_logprobs(self.teacher, mbs) if self.teacher is not None else None

        def loss_of(k: int, mb: MicroBatch) -> Any:
            """Micro-batch ``k``'s loss; its detached inputs are kept for the step's metrics."""
            with self.compiled_ctx():
                x = self._loss_inputs(mb, olds[k], refs[k] if refs else None, teach[k] if teach else None)
            loss, _ = self.algorithm.loss(x, cfg.algorithm)
            self._unit_losses.append(loss.detach())
            self._inputs.append(dataclasses.replace(x, logprobs=x.logprobs.detach(),
                                                    entropy=None if x.entropy is None else x.entropy.detach()))
            self._mismatch.add(x.logprobs, x.rollout_logprobs, x.loss_mask, x.seq_ids,
                               staleness_of(mb.items, self.step))
            return loss

        self._backward(mbs, loss_of)
        for mb in mbs:
            n_tok, n_seq = count_normalisers(mb.loss_mask, mb.seq_ids, len(mb.items))
            self._n_tok += n_tok
            self._n_seq += n_seq
            self._tokens += mb.real_tokens
            self._slots += mb.num_tokens
        self._n_items += len(items)
        self._n_mb += len(mbs)
        self._compute += time.perf_counter() - t0

    def _loss_inputs(self, mb: MicroBatch, old: Any, ref: Any, teacher: Any) -> Any:
        """The algorithm's inputs of one micro-batch, with the deferred normalisers (1)."""
        from relax_hpc.algorithms.base import LossInputs

        logp, ent = self.sequence_logprobs(self.model, mb, with_entropy=True)
        return LossInputs(
            logprobs=logp, old_logprobs=mb.rollout_logprobs if old is None else old,
            rollout_logprobs=mb.rollout_logprobs, advantages=mb.advantages, loss_mask=mb.loss_mask,
            seq_ids=mb.seq_ids, num_seqs=len(mb.items), global_num_tokens=1.0, global_num_seqs=1.0,
            max_response_tokens=self.cfg.rollout.sampling.max_new_tokens, entropy=ent, ref_logprobs=ref,
            teacher_logprobs=teacher, sample_weights=mb.weights,
        )

    def _backward(self, mbs: list[MicroBatch], loss_of: Callable[[int, MicroBatch], Any]) -> None:
        """Forward and backward of each micro-batch in turn; ``loss_of(k, mb)`` runs the forward and gives micro-batch
        ``k``'s loss (a backend whose model is split into pipeline stages runs them through its schedule)."""
        for k, mb in enumerate(mbs):
            loss_of(k, mb).backward()

    def _old_logprobs(self, mbs: list[MicroBatch]) -> list[Any]:
        """Per micro-batch, the log-probs the ratio is taken against, or None for the rollout's: the trainer's own
        (proximal) ones for every token with ``algorithm.proximal``, else for the tokens of stale samples."""
        import torch

        proximal = self.cfg.algorithm.proximal
        need = [k for k, mb in enumerate(mbs) if proximal or any(it.sample.stale for it in mb.items)]
        out: list[Any] = [None] * len(mbs)
        for k, prox in zip(need, self._policy_logprobs([mbs[k] for k in need]), strict=True):
            if prox is not None and not proximal:
                mb = mbs[k]
                per_token = torch.tensor([it.sample.stale for it in mb.items], device=prox.device)[mb.seq_ids]
                prox = torch.where(per_token, prox, mb.rollout_logprobs)
            out[k] = prox
        return out

    def _policy_logprobs(self, mbs: list[MicroBatch]) -> list[Any]:
        """The trained model's log-probs [T] of each micro-batch, without gradients (None where a pipeline stage
        does not have them)."""
        import torch

        with torch.no_grad():
            return [self.sequence_logprobs(self.model, mb)[0] for mb in mbs]

    def finish_step(self) -> dict[str, float]:
        """Divide gradients by the global normaliser (all ranks), clip, step the optimizer. Returns metrics."""
        import torch

        t0 = time.perf_counter()
        n_tok, n_seq, n_items, unit_loss = self._n_tok, self._n_seq, float(self._n_items), self._unit_loss()
        n = self._all_reduce({"tok": n_tok, "seq": n_seq, "items": n_items, "loss": unit_loss})
        n_tok, n_seq, n_items, unit_loss = n["tok"], n["seq"], n["items"], n["loss"]
        divisor = max(n_tok if self.cfg.algorithm.loss_agg == "token_mean" else n_seq, 1.0)
        # FSDP averages gradients over ranks; the step's gradient is their SUM divided by the global normaliser.
        scale = self.world_size / divisor
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm_f = float(grad_norm)
        lr = self._lr()
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        if math.isfinite(grad_norm_f):
            self.optimizer.step()
        else:
            log.warning("non-finite gradient norm at step %d: update skipped", self.step)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        metrics = self._step_metrics(n_tok, n_seq)
        check_one_normaliser(self.algorithm, metrics[_LOSS], unit_loss / divisor)
        metrics.update({"train/grad_norm": grad_norm_f, "train/lr": lr, "train/num_micro_batches": float(self._n_mb),
                        "train/tokens": float(self._tokens),
                        "train/padding_fraction": 1.0 - self._tokens / self._slots if self._slots else 0.0,
                        "perf/train_time": self._compute + time.perf_counter() - t0,
                        "train/samples": n_items})
        self._inputs = []
        return metrics

    def _step_metrics(self, n_tok: float, n_seq: float) -> dict[str, float]:
        """The algorithm's metrics of the whole step: each micro-batch's loss inputs again, now with the global
        normalisers, summed over micro-batches and ranks (the loss too, as ``train/loss``)."""
        import dataclasses

        import torch

        from relax_hpc.algorithms.base import concat_inputs

        sums: dict[str, float] = {}
        if self._inputs:  # one loss call over all micro-batches (metrics are sums), one device sync
            x = dataclasses.replace(concat_inputs(self._inputs), global_num_tokens=n_tok, global_num_seqs=n_seq)
            with torch.no_grad():
                loss, m = self.algorithm.loss(x, self.cfg.algorithm)
            sums = dict(zip([_LOSS, *m], _floats([loss, *m.values()]), strict=True))
        # every key, also for a step without items (a rank without data, a plan whose groups were all dropped)
        reduced = self._all_reduce({**_with_keys(sums, self._metric_keys()), **self._mismatch.sums()})
        mismatch = mismatch_metrics(reduced, self._mismatch.maxima(self.world_size))  # pops its sums
        return {**reduced, **mismatch}

    def _unit_loss(self) -> float:
        """The step's loss with normaliser 1: the micro-batches' losses summed (one device sync per step)."""
        import torch

        return float(torch.stack(self._unit_losses).double().sum()) if self._unit_losses else 0.0

    def _all_reduce(self, d: dict[str, float]) -> dict[str, float]:
        """``d`` summed over the data-parallel replicas (every rank one here)."""
        return _all_reduce_dict(d, self.device) if self.world_size > 1 else d

    def _metric_keys(self) -> list[str]:
        """The algorithm's metric names (every rank the same, even one without items this step)."""
        import torch

        from relax_hpc.algorithms.base import LossInputs

        if self._keys is not None:
            return self._keys

        z = torch.zeros(1)
        x = LossInputs(logprobs=z, old_logprobs=z, rollout_logprobs=z, advantages=z, loss_mask=torch.ones(1),
                       seq_ids=torch.zeros(1, dtype=torch.long), num_seqs=1, global_num_tokens=1.0,
                       global_num_seqs=1.0, max_response_tokens=1, entropy=z,
                       ref_logprobs=z if self.cfg.algorithm.kl_coef > 0 and self.ref_model is not None else None,
                       teacher_logprobs=z if self.teacher is not None else None, sample_weights=torch.ones(1))
        with torch.no_grad():
            self._keys = [_LOSS, *self.algorithm.loss(x, self.cfg.algorithm)[1]]
        return self._keys

    def _use_rows(self, items: list[TrainItem]) -> bool:
        """Several short rows when the full-logits tensor of a micro-batch stays small (small vocabularies) or is
        never built (trainer/logprobs.py): attention then stays within rows, whatever the kernel."""
        from relax_hpc.trainer.logprobs import model_supported

        if model_supported(self.generation_model(), world_size=self.world_size):
            return True
        vocab = int(getattr(getattr(self.model, "config", None), "vocab_size", 1 << 20))
        return vocab * self.cfg.trainer.micro_batch_tokens <= (1 << 26)

    def _aux_logprobs(self, model: Any, mbs: list[MicroBatch]) -> list[Any]:
        import torch

        with torch.no_grad():
            return [self.sequence_logprobs(model, mb)[0] for mb in mbs]

    def _lr(self) -> float:
        t = self.cfg.trainer
        if t.warmup_steps and self.step < t.warmup_steps:
            return t.lr * (self.step + 1) / t.warmup_steps
        return t.lr

    def sft_warmup(self, prompts: Any, tokenizer: Any, *, steps: int, lr: float, batch_size: int,
                   max_tokens: int) -> dict[str, float]:
        from relax_hpc.trainer.sft import run_warmup

        return run_warmup(self.model, tokenizer, prompts, steps=steps, lr=lr, batch_size=batch_size,
                          max_tokens=max_tokens, device=self.device)

    # ------------------------------------------------------------------ weights out
    def full_state_dict(self, *, copy: bool = False) -> dict[str, Any]:
        """Unsharded model weights on the CPU under HF names (every rank must call this under FSDP; rank 0 gets
        the tensors). Without FSDP and on the CPU the tensors are the live parameters unless ``copy``;
        ``torch.distributed.checkpoint``'s generic path costs ~4 ms per call even for a tiny model, paid on every
        weight hand-over, so one rank takes the plain state dict."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.lora and self.world_size == 1:  # the adapter only (its tensors are fresh copies on the CPU)
            from relax_hpc.models.lora import adapter_state

            return {k: v.clone() for k, v in adapter_state(self.model).items()} if copy else adapter_state(self.model)
        if self.lora:  # FSDP: the trained parameters gathered (every rank calls), rank 0 names them as PEFT does
            from peft import get_peft_model_state_dict

            trained = self._trained_full()
            return get_peft_model_state_dict(self.model, state_dict=trained) if self.rank == 0 else {}
        if self.world_size == 1:
            sd = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
            return self.detached(sd) if copy else sd
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def state_buckets(self, bucket_bytes: int) -> Any:
        """Buckets of whole tensors; under FSDP one parameter is gathered at a time (every rank), so no rank holds
        more than a bucket of the full model beside its shard."""
        if self.world_size == 1 or self.lora:  # an adapter is small: gathered at once (full_state_dict)
            yield from super().state_buckets(bucket_bytes)
            return
        bucket: dict[str, Any] = {}
        size = 0
        for name, t in self.model.state_dict().items():
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            n = full.numel() * full.element_size()
            if size and size + n > bucket_bytes:  # by size, so every rank yields as many buckets
                yield bucket
                bucket, size = {}, 0
            if self.rank == 0:
                bucket[name] = full.detach().cpu()
            size += n
        if size:
            yield bucket

    def detached(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``state_dict`` with the tensors that are live (unsharded) parameter storage copied, the rest as given."""
        import contextlib

        live = set()
        for p in self.model.parameters():
            with contextlib.suppress(RuntimeError):  # sharded parameters have no plain storage
                live.add(p.untyped_storage().data_ptr())
        return {k: v.detach().clone() if v.untyped_storage().data_ptr() in live else v for k, v in state_dict.items()}

    def hf_config(self) -> dict[str, Any]:
        return dict(self.model.config.to_dict())

    def adapter_config(self) -> dict[str, Any] | None:
        if not self.lora:
            return None
        from relax_hpc.models.lora import adapter_config

        return {"config": adapter_config(self.model), "base": self.base}

    def generation_config(self) -> dict[str, Any] | None:
        gen = getattr(self.model, "generation_config", None)
        return None if gen is None else dict(gen.to_dict())

    def generation_model(self) -> Any:
        return self.model.get_base_model() if self.lora else self.model  # the HF module (adapters injected)

    def host_copy_async(self, *, optimizer: bool = False) -> HostCopy | None:
        """One GPU rank training the HF module itself: pinned copies on a side stream (:class:`PinnedCopier`); with
        ``model.lora`` on one GPU the adapter's tensors (the weights a snapshot holds; a checkpoint's copy goes the
        synchronous way)."""
        adapter = self.lora and not optimizer and self.world_size == 1 and self._on_cuda()
        if not adapter and not hf_module_on_one_gpu(self):
            return None
        if self._copier is None:
            self._copier = PinnedCopier(self.optimizer)
        if adapter:
            from relax_hpc.models.lora import adapter_tensors

            return self._copier.copy(self.model, state=adapter_tensors(self.model))
        return self._copier.copy(self.model, self.optimizer if optimizer else None)

    def _on_cuda(self) -> bool:
        p = next(self.model.parameters(), None)
        return p is not None and p.is_cuda

    def export_hf(self, path: Path | str, tokenizer: Any) -> None:
        if self.lora and self.world_size > 1:  # FSDP: the adapter gathered (every rank), rank 0 writes PEFT's files
            self._export_adapter(Path(path), tokenizer)
            return
        if self.lora:  # the adapter folder (PEFT's files); merged into the base by a later export
            Path(path).mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
            return
        sd = self.full_state_dict()
        if self.rank != 0:
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path, state_dict=sd, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    def _export_adapter(self, path: Path, tokenizer: Any) -> None:
        import json

        from safetensors.torch import save_file

        from relax_hpc.models.lora import adapter_config

        state = self.full_state_dict()
        if self.rank != 0:
            return
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(adapter_config(self.model), indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.lora and self.world_size == 1:  # the adapter (and modules_to_save) and their optimizer state
            from relax_hpc.models.lora import trainable_state

            return trainable_state(self.model), self.full_optimizer_state()
        if self.lora:  # FSDP: the same, gathered
            return self._trained_full(), self.full_optimizer_state()
        return self.full_state_dict(), self.full_optimizer_state()

    def _trained_full(self) -> dict[str, Any]:
        """FSDP: the trained parameters (adapters, ``modules_to_save``) unsharded on rank 0's CPU under the module's
        names; every rank calls."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                       ignore_frozen_params=True))
        return {k: v for k, v in sd.items() if k in self._trained}  # a tied output layer is listed, though frozen

    def load_checkpoint_state(self, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None) -> None:
        if self.lora and self.world_size == 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            from relax_hpc.models.lora import load_trainable_state

            load_trainable_state(self.model, model_sd)
            if optim_sd is not None:
                set_optimizer_state_dict(self.model, self.optimizer, optim_sd,
                                         options=StateDictOptions(full_state_dict=True))
            return
        self.load_full_state(model_sd, optim_sd)

    def full_optimizer_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_state(self, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, strict=not self.lora)  # lora: the trained parameters only
        if self.world_size == 1:  # copied into the live parameters, on their device (the generic path may put
            self.model.load_state_dict(model_sd)  # the checkpoint's CPU tensors in their place)
        else:
            set_model_state_dict(self.model, model_sd, options=opts)
        if optim_sd is not None:
            set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=opts)


TorchTrainer = TorchBackend
"""The round-1 name of :class:`TorchBackend`."""


def compiled_layers(model: Any, cfg: RecipeConfig, device: str) -> Any:
    """The context the training forward runs in: compiled decoder layers with ``trainer.compile_layers`` on a GPU
    (models/compiled.py), else nothing."""
    import contextlib

    if not (cfg.trainer.compile_layers and str(device).startswith("cuda")):
        return contextlib.nullcontext
    from relax_hpc.models.compiled import CompiledLayers

    return CompiledLayers(model).active


def check_one_normaliser(algorithm: Any, loss: float, deferred: float) -> None:
    """The deferred normalisation (normaliser 1, the gradient divided afterwards) is exact only for a loss whose
    every term is divided by the ``loss_agg`` normaliser; an algorithm that mixes in another one is refused."""
    if math.isfinite(loss) and abs(loss - deferred) > 1e-4 * max(1.0, abs(loss)):
        raise ValueError(f"algorithm {getattr(algorithm, 'name', algorithm)!r}: its loss divides terms by more than "
                         f"one normaliser ({loss} with the step's normalisers, {deferred} by deferred scaling); "
                         "every loss term must use common.aggregate with cfg.loss_agg")


def _floats(values: list[Any]) -> list[float]:
    """Scalars (tensors on one device, or numbers) as floats, with one device-to-host copy."""
    import torch

    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    host = iter(torch.stack([t.detach().double().reshape(()) for t in tensors]).tolist() if tensors else [])
    return [next(host) if isinstance(v, torch.Tensor) else float(v) for v in values]


def _with_keys(d: dict[str, float], keys: list[str]) -> dict[str, float]:
    return {**{k: 0.0 for k in keys}, **d}


def _fully_shard(model: Any, hf_module: Any) -> Any:
    """FSDP2: shard each decoder layer of ``hf_module`` (the HF model; ``model`` itself, or the module a PEFT model
    wraps), then the root ``model``."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(hf_module, "model", hf_module), "layers", [])
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _all_reduce_dict(d: dict[str, float], device: str) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    keys = sorted(d)
    t = torch.tensor([d[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))
