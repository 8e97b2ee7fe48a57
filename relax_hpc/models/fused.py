"""Fused kernels swapped into a loaded HF model where they compute the same function.

transformers' RMSNorm modules (Qwen2/Qwen3/Llama ``*RMSNorm``) run as ~8 small kernels each way (upcast, square,
mean, rsqrt, two multiplies, downcast); a Qwen3 layer has four of them, which made elementwise kernels the largest
share of a training step and of a decode step on the GPU (``bench step --profile``). :func:`fuse_rms_norms` points
their forward at ``torch.nn.functional.rms_norm`` (one fused kernel forward and backward on CUDA): the same
normalisation computed in float32; the weight is applied before the cast to the model's dtype instead of after
(one bf16 rounding less), so float32 results are identical up to rounding (tests/unit/test_fused.py).
"""

from __future__ import annotations

import types
from typing import Any

import torch


def _rms_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(hidden_states, (hidden_states.shape[-1],), self.weight,
                                        self.variance_epsilon)


def is_plain_rms_norm(module: Any) -> bool:
    """An HF ``*RMSNorm`` of the plain form ``weight * normalise(x)`` (not Gemma's ``1 + weight``)."""
    name = type(module).__name__
    if not name.endswith("RMSNorm") or name.startswith("Gemma"):
        return False
    w = getattr(module, "weight", None)
    return isinstance(w, torch.nn.Parameter) and w.dim() == 1 and hasattr(module, "variance_epsilon")


def fuse_rms_norms(model: Any) -> int:
    """Swap the forward of every plain RMSNorm in ``model`` for the fused one; returns how many."""
    n = 0
    for module in model.modules():
        if is_plain_rms_norm(module):
            module.forward = types.MethodType(_rms_forward, module)
            n += 1
    return n
