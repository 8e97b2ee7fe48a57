"""The ``torch`` trainer backend: an HF causal LM, AdamW, packed micro-batches, FSDP2 over ranks.

One :meth:`TorchTrainer.train_step` = one optimizer update over a step's items: they are packed into micro-batches
of at most ``trainer.micro_batch_tokens`` tokens (no padding), each micro-batch's loss is already divided by the
step's global normaliser (tokens or sequences over all micro-batches and ranks), so accumulating gradients over
micro-batches and averaging over data-parallel ranks equals one big-batch gradient.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.trainer.batch import DEFAULT_ATTN_SCALE, MicroBatch, TrainItem, pack, response_logits

log = logging.getLogger(__name__)


class TorchTrainer:
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
        self.model = model
        if world_size > 1:
            self.model = _fully_shard(model)
        self.model.train()
        t = cfg.trainer
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=t.lr,
                                           betas=tuple(t.betas), weight_decay=t.weight_decay,
                                           foreach=device != "cpu")
        self.ref_model = ref_model
        self.teacher = teacher
        temp = cfg.rollout.sampling.temperature
        self.temperature = temp if temp > 0 else 1.0
        self.step = 0

    # ------------------------------------------------------------------ forward
    def sequence_logprobs(self, model: Any, mb: MicroBatch, *, with_entropy: bool = False) -> tuple[Any, Any]:
        """Log-probs of the response tokens [T] (and entropies [T]) under ``model`` at the sampling temperature."""
        import torch

        logits = response_logits(model, mb).float() / self.temperature  # [T, V]
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, mb.targets[:, None])[:, 0]
        ent = None
        if with_entropy:
            ent = -(logp_all.exp() * logp_all).sum(-1)
        return logp, ent

    # ------------------------------------------------------------------ train
    def train_step(self, items: list[TrainItem]) -> dict[str, float]:
        """One optimizer update over ``items`` (this rank's share of the step). Returns metrics."""
        self.begin_step()
        self.accumulate(items)
        return self.finish_step()

    def begin_step(self) -> None:
        """Start a step whose micro-batches may arrive over time (micro-batch streaming)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._sums: dict[str, float] = {}
        self._n_tok = 0.0
        self._n_seq = 0.0
        self._n_mb = 0
        self._tokens = 0
        self._slots = 0
        self._t0 = time.perf_counter()
        self._compute = 0.0

    def accumulate(self, items: list[TrainItem]) -> None:
        """Forward + backward over ``items`` now (whole groups, advantages set). Losses are left unnormalised
        (normaliser 1) and the gradient is divided by the step's global normaliser in :meth:`finish_step`, which
        is only known once the last micro-batch arrived; gradients are linear in that scale, so the update is the
        same as for one big batch."""
        import torch

        from relax_hpc.algorithms.base import LossInputs

        if not items:
            return
        t0 = time.perf_counter()
        cfg = self.cfg
        a = cfg.algorithm
        hidden = int(getattr(getattr(self.model, "config", None), "hidden_size", 0) or 0)
        mbs = pack(items, cfg.trainer.micro_batch_tokens, device=self.device, rows=self._use_rows(items),
                   attn_scale=6.0 * hidden if hidden else DEFAULT_ATTN_SCALE)
        olds: list[Any] = []
        if a.proximal:  # decoupled PPO: the proximal policy is the trainer's own policy before this update
            with torch.no_grad():
                olds = [self.sequence_logprobs(self.model, mb)[0] for mb in mbs]
        refs = self._aux_logprobs(self.ref_model, mbs) if a.kl_coef > 0 and self.ref_model is not None else None
        teach = self._aux_logprobs(self.teacher, mbs) if self.teacher is not None else None
        for k, mb in enumerate(mbs):
            logp, ent = self.sequence_logprobs(self.model, mb, with_entropy=True)
            x = LossInputs(
                logprobs=logp, old_logprobs=olds[k] if olds else mb.rollout_logprobs,
                rollout_logprobs=mb.rollout_logprobs, advantages=mb.advantages, loss_mask=mb.loss_mask,
                seq_ids=mb.seq_ids, num_seqs=len(mb.items), global_num_tokens=1.0, global_num_seqs=1.0,
                max_response_tokens=cfg.rollout.sampling.max_new_tokens, entropy=ent,
                ref_logprobs=refs[k] if refs else None, teacher_logprobs=teach[k] if teach else None,
                sample_weights=mb.weights,
            )
            loss, m = self.algorithm.loss(x, a)
            loss.backward()
            self._sums["train/loss"] = self._sums.get("train/loss", 0.0) + float(loss.detach())
            for name, v in m.items():
                self._sums[name] = self._sums.get(name, 0.0) + float(v)
            self._n_tok += float(mb.loss_mask.sum())
            self._tokens += mb.real_tokens
            self._slots += mb.num_tokens
        self._n_seq += float(len(items))
        self._n_mb += len(mbs)
        self._compute += time.perf_counter() - t0

    def finish_step(self) -> dict[str, float]:
        """Divide gradients by the global normaliser (all ranks), clip, step the optimizer. Returns metrics."""
        import torch

        t0 = time.perf_counter()
        sums, n_tok, n_seq = dict(self._sums), self._n_tok, self._n_seq
        if self.world_size > 1:
            sums["__n_tok"], sums["__n_seq"] = n_tok, n_seq
            sums = _all_reduce_dict(sums, self.device)
            n_tok, n_seq = sums.pop("__n_tok"), sums.pop("__n_seq")
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
        metrics = {k: v / divisor for k, v in sums.items()}
        metrics.update({"train/grad_norm": grad_norm_f, "train/lr": lr, "train/num_micro_batches": float(self._n_mb),
                        "train/tokens": float(self._tokens),
                        "train/padding_fraction": 1.0 - self._tokens / self._slots if self._slots else 0.0,
                        "perf/train_time": self._compute + time.perf_counter() - t0,
                        "train/samples": n_seq})
        return metrics

    def _use_rows(self, items: list[TrainItem]) -> bool:
        """Several short rows when the full-logits tensor of a micro-batch stays small (small vocabularies)."""
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

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, Any]:
        """Unsharded model weights on the CPU (every rank must call this under FSDP; rank 0 gets the tensors).

        Without FSDP the CPU tensors are the live parameters (no copy: copy them before the next optimizer step if
        they must not change); ``torch.distributed.checkpoint``'s generic path costs ~4 ms per call even for a tiny
        model, paid on every weight hand-over."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.world_size == 1:
            return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

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

        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, model_sd, options=opts)
        if optim_sd is not None:
            set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=opts)


def _fully_shard(model: Any) -> Any:
    """FSDP2: shard each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(getattr(model, "model", model), "layers", [])
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
