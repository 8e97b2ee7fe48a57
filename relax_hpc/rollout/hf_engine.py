"""The ``hf`` engine: a HF model in-process, with sampling, n samples per prompt and log-probs.

Text prompts to a plain causal LM go through :mod:`relax_hpc.rollout.decode` (a sampling loop with a KV cache, 1.3x
as fast as ``generate`` on the demo model: ``relax-hpc bench generate``); multimodal prompts, stop strings, sharded
(FSDP) weights and ``rollout.hf_decoder: generate`` use ``transformers.generate``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from relax_hpc.config.schema import SamplingConfig
from relax_hpc.rollout.engine import Completion, RolloutEngine


class HFEngine(RolloutEngine):
    """Generate with a HF causal LM. In ``colocate`` mode the model object is the trainer's own (weights shared).

    ``seed`` is part of the engine interface; this engine samples with torch's global generator, which the role
    seeds (:func:`relax_hpc.modes.components.seed_everything`), so it keeps none of its own."""

    def __init__(self, model: Any, tokenizer: Any, sampling: SamplingConfig, *, device: str = "cpu",
                 batch_prompts: int = 16, seed: int = 0, decoder: str = "auto"):
        self.model = model
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.device = device
        self.batch_prompts = batch_prompts
        self.version = 0
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self._loop: bool | None = None if decoder == "auto" else False  # decided at the first batch

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        missing = [m for m in missing if not m.endswith("lm_head.weight")]  # tied embeddings
        if missing or unexpected:
            raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.version = version

    def generate(self, prompts: list[list[int]], n: int, *,
                 multimodal: list[dict[str, Any] | None] | None = None) -> list[list[Completion]]:
        out: list[list[Completion]] = []
        for k in range(0, len(prompts), self.batch_prompts):
            chunk = prompts[k:k + self.batch_prompts]
            mm = multimodal[k:k + self.batch_prompts] if multimodal else None
            if mm and any(mm):
                for p, m in zip(chunk, mm):  # multimodal prompts carry per-prompt tensors: one at a time
                    out.extend(self._generate_batch([p], n, m))
            else:
                out.extend(self._generate_batch(chunk, n, None))
        return out

    def _generate_batch(self, prompts: list[list[int]], n: int, mm: dict[str, Any] | None) -> list[list[Completion]]:
        import torch

        s = self.sampling
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p):] = 1
        extra = {k: torch.as_tensor(v).to(self.device) for k, v in (mm or {}).items()}
        # Sharded (FSDP) weights: every rank must run the same number of forward passes, whatever its prompts.
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            extra["synced_gpus"] = True
        if self._loop is None:
            from relax_hpc.rollout.decode import loop_supported

            self._loop = loop_supported(self.model)
        greedy = s.temperature == 0
        temperature = 1.0 if greedy else s.temperature
        version = self.version
        was_training = self.model.training
        self.model.eval()
        t0 = time.perf_counter()
        try:
            if self._loop and not extra and not s.stop:
                from relax_hpc.rollout.decode import sample

                seqs, logp = sample(self.model, ids.to(self.device), attn.to(self.device), n=n,
                                    max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                                    top_p=s.top_p, eos_id=self.eos_id, pad_id=self.pad_id)
                seqs, logp = seqs.cpu(), logp.cpu()
            else:
                seqs, logp = self._generate(ids, attn, n, extra, greedy, temperature)
        finally:
            if was_training:
                self.model.train()
        dt = time.perf_counter() - t0
        result: list[list[Completion]] = []
        seqs_np, logp_np = seqs.numpy(), logp.numpy()
        per_seq = dt / max(1, len(seqs_np))
        for i in range(len(prompts)):
            group = []
            for j in range(n):
                row = i * n + j
                toks, lps = seqs_np[row], logp_np[row]
                length, reason = _response_length(toks, self.eos_id, self.pad_id, s.max_new_tokens)
                if reason == "length" and s.stop and length < len(toks):
                    reason = "stop"
                group.append(Completion(token_ids=toks[:length].astype(np.int32),
                                        logprobs=lps[:length].astype(np.float32), finish_reason=reason,
                                        version_first=version, version_last=version,
                                        timings={"generate": per_seq}))
            result.append(group)
        return result

    def _generate(self, ids: Any, attn: Any, n: int, extra: dict[str, Any], greedy: bool,
                  temperature: float) -> tuple[Any, Any]:
        """transformers ``generate``: (response tokens ``[B*n, R]``, their log-probs) on the CPU."""
        import torch

        s = self.sampling
        width = ids.shape[1]
        repeat = n if greedy else 1  # generate refuses n greedy sequences: they are one sequence n times
        n = 1 if greedy else n
        with torch.no_grad():
            gen = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=attn.to(self.device), do_sample=not greedy,
                temperature=temperature if not greedy else None, top_p=s.top_p if not greedy else None,
                top_k=s.top_k if not greedy else None, max_new_tokens=s.max_new_tokens,
                num_return_sequences=n, return_dict_in_generate=True, output_logits=True,
                pad_token_id=self.pad_id, eos_token_id=self.eos_id,
                stop_strings=s.stop or None, tokenizer=self.tokenizer if s.stop else None, **extra,
            )
        seqs = gen.sequences[:, width:].cpu()
        logits = torch.stack(gen.logits, dim=1).float().cpu()  # [B*n, R, V]
        logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, seqs[..., None])[..., 0]
        return seqs.repeat_interleave(repeat, dim=0), logp.repeat_interleave(repeat, dim=0)


def _response_length(toks: np.ndarray, eos: int, pad: int, max_new: int) -> tuple[int, str]:
    """Tokens up to and including the first EOS; generation pads finished rows with ``pad``."""
    hits = np.nonzero(toks == eos)[0]
    if len(hits):
        return int(hits[0]) + 1, "stop"
    if pad != eos:
        pads = np.nonzero(toks == pad)[0]
        if len(pads):
            return int(pads[0]), "stop"
    return min(len(toks), max_new), "length"
