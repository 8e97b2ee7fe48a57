"""Decoder layers compiled for training only (``trainer.compile_layers``).

A 0.6B-shape training step on a GPU spends about a quarter of its time in small elementwise kernels per layer (RoPE,
SiLU x up, residual adds, casts: ``bench step --profile``). ``torch.compile`` of each decoder layer fuses them. The
compiled forward is switched on only inside :meth:`CompiledLayers.active` (the trainer's forward and backward): in
colocate the ``hf`` engine decodes with the same modules through its own CUDA-graph loop, and checkpoints and exports
see the plain modules, so nothing outside training changes. The layers share one compiled graph (their parameters are
graph inputs), compiled with dynamic shapes so new micro-batch shapes do not recompile. A compile failure falls back to
the eager layers with one warning; an out-of-memory error is raised as it is.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64
"""torch._dynamo's per-code-object limit is raised to this (every layer runs the same ``forward``)."""


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of an HF causal LM (``model.model.layers`` or the first ``*.layers`` module list)."""
    import torch

    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        return list(layers)
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList):
            return list(module)
    return []


def raise_recompile_limit() -> None:
    """torch._dynamo's per-code-object recompile limit to at least :data:`RECOMPILE_LIMIT`."""
    import torch

    cfg = torch._dynamo.config
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, knob):
            setattr(cfg, knob, max(int(getattr(cfg, knob)), RECOMPILE_LIMIT))


class Fallback:
    """Whether compiling failed; shared by the functions that fall back together (one warning for all)."""

    failed = False


class CompiledFn:
    """``fn`` compiled with dynamic shapes; after a compile failure (one warning per ``state``) ``fn`` itself."""

    def __init__(self, fn: Callable[..., Any], what: str, state: Fallback | None = None):
        import torch

        raise_recompile_limit()
        self.eager, self.what, self.state = fn, what, state or Fallback()
        self.compiled = torch.compile(fn, dynamic=True)

    @property
    def failed(self) -> bool:
        return self.state.failed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        if self.state.failed:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # compilation failed: nothing of fn ran yet
            self.state.failed = True
            log.warning("%s: torch.compile failed (%s: %s); running it eagerly", self.what, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
            return self.eager(*args, **kwargs)


class CompiledLayers:
    """``torch.compile``d forwards of a model's decoder layers, in force only inside :meth:`active`."""

    def __init__(self, model: Any):
        self.layers = decoder_layers(model)
        self.state = Fallback()
        self._calls = [CompiledFn(layer.forward, "trainer.compile_layers", self.state) for layer in self.layers]

    @property
    def failed(self) -> bool:
        return self.state.failed

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The layers run their compiled forward inside this block (an instance attribute over the class's)."""
        if self.failed or not self.layers:
            yield
            return
        for layer, call in zip(self.layers, self._calls):
            layer.forward = call
        try:
            yield
        finally:
            for layer in self.layers:
                layer.__dict__.pop("forward", None)
