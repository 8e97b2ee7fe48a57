"""Low-rank adapters on the policy (``model.lora``) through PEFT: the targets checked against the model, the adapter
injected in place (a colocated engine sharing the module generates with it), the adapter's own tensors and config."""

from __future__ import annotations

import functools
from typing import Any

from relax_hpc.config.model import LoraConfig
from relax_hpc.errors import UserError


def _linear_names(model: Any) -> list[str]:
    import torch

    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def check_targets(model: Any, cfg: LoraConfig) -> None:
    """Every ``target_modules`` and ``modules_to_save`` name is a module of ``model`` (one :class:`UserError`)."""
    names = [name for name, _ in model.named_modules()]
    for key, wanted in (("target_modules", cfg.target_modules), ("modules_to_save", cfg.modules_to_save)):
        for t in wanted:
            if not any(n == t or n.endswith("." + t) for n in names):
                linear = ", ".join(_linear_names(model))
                raise UserError(f"model.lora.{key}: the model has no module {t!r} (its linear layers: {linear})")


def apply_lora(model: Any, cfg: LoraConfig) -> Any:
    """``model`` with LoRA adapters injected in place (the returned ``PeftModel`` wraps the same module): only the
    adapters and ``modules_to_save`` require gradients."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    check_targets(model, cfg)
    pcfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules=list(cfg.target_modules), modules_to_save=list(cfg.modules_to_save) or None,
                          task_type="CAUSAL_LM", bias="none")
    peft_model = get_peft_model(model, pcfg)
    compute_in_input_dtype(peft_model)
    return peft_model


def compute_in_input_dtype(peft_model: Any) -> int:
    """On a half-precision base, the adapters keep float32 parameters (PEFT's default: their gradients and AdamW
    state in float32, so small updates are not rounded away) but compute in the layer input's dtype, as mixed
    precision does. PEFT's own path casts each adapted layer's input to float32 for the adapter and autograd keeps
    that copy for the backward pass: at the Qwen3-4B shape that was 34 % more saved activation memory than full
    fine-tuning (234 against 175 MB per 1,024 tokens per layer), so LoRA saved far less memory than it should.
    Here the input goes to the adapter as it is (the tensor the base layer saved already), and each adapter matrix
    is cast to the input's dtype in its forward (a rank x width copy). Returns the adapter matrices changed (none
    on a float32 base, where nothing is cast)."""
    import torch
    from peft.tuners.lora import LoraLayer

    changed = 0
    for m in peft_model.modules():
        if not isinstance(m, LoraLayer):
            continue
        base = m.get_base_layer().weight
        if base.dtype not in (torch.bfloat16, torch.float16):
            continue
        m.cast_input_dtype_enabled = False  # PEFT's switch (peft.helpers.disable_input_dtype_casting)
        for matrices in (m.lora_A, m.lora_B):
            for lin in matrices.values():
                if type(lin) is torch.nn.Linear:
                    lin.__class__ = input_dtype_linear()  # the same parameters, under the same names
                    changed += 1
    return changed


@functools.cache
def input_dtype_linear() -> type:
    """The ``torch.nn.Linear`` subclass of :func:`compute_in_input_dtype` (made on first use: torch is imported
    lazily)."""
    import torch
    import torch.nn.functional as F

    class InputDtypeLinear(torch.nn.Linear):
        """An adapter matrix that computes in its input's dtype (its parameters stay as they are)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.weight.to(x.dtype), bias)

    return InputDtypeLinear


def adapter_state(peft_model: Any) -> dict[str, Any]:
    """The adapter's tensors under PEFT's file names (``adapter_model.safetensors``), detached, on the CPU."""
    return {k: v.detach().cpu() for k, v in adapter_tensors(peft_model).items()}


def adapter_tensors(peft_model: Any) -> dict[str, Any]:
    """The adapter's tensors under PEFT's file names, where they are (the module's own: not to be written)."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(peft_model))


def adapter_config(peft_model: Any) -> dict[str, Any]:
    """The ``adapter_config.json`` content (the base model named by ``base_model_name_or_path``)."""
    import json

    cfg = peft_model.peft_config[peft_model.active_adapter]
    return dict(json.loads(json.dumps(cfg.to_dict(), default=_plain)))


def _plain(v: Any) -> Any:
    return sorted(v) if isinstance(v, set) else str(v)


def trainable_state(peft_model: Any) -> dict[str, Any]:
    """The trained parameters (adapters, ``modules_to_save``) under the module's own names: a checkpoint's model
    part."""
    return {n: p.detach().cpu() for n, p in peft_model.named_parameters() if p.requires_grad}


def load_trainable_state(peft_model: Any, sd: dict[str, Any]) -> None:
    """Copy a checkpoint's :func:`trainable_state` back (every trained parameter must be there, nothing else)."""
    want = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    if set(sd) != want:
        missing, extra = sorted(want - set(sd)), sorted(set(sd) - want)
        raise UserError(f"the checkpoint's adapter does not fit model.lora (missing {missing[:3]}, unexpected "
                        f"{extra[:3]}); resume with the model.lora it was written with")
    result = peft_model.load_state_dict(sd, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys


def base_identity(model: Any, path: str) -> dict[str, str]:
    """The base model an adapter belongs to: its ``model.path`` and the sha256 of its weights (every tensor's name,
    dtype, shape and bytes, in state-dict order; computed once, before the adapter is injected)."""
    import hashlib

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        c = t.detach().contiguous().cpu()
        h.update(f"{name}|{c.dtype}|{tuple(c.shape)}\n".encode())
        h.update(c.view(-1).view(_byte_dtype()).numpy().tobytes() if c.numel() else b"")
    return {"path": path, "sha256": h.hexdigest()}


def _byte_dtype() -> Any:
    import torch

    return torch.uint8


def adapter_name(version: int) -> str:
    """The name a server engine loads adapter version ``version`` under (its snapshot folder's name)."""
    return f"v{version:06d}"


ADAPTER_PREFIX = "base_model.model."
"""Every tensor name of an adapter's state (PEFT's file names) starts with this."""


def is_adapter_state(names: Any) -> bool:
    """Whether tensor names are an adapter's (PEFT's file names) rather than a model's."""
    names = list(names)
    return bool(names) and all(n.startswith(ADAPTER_PREFIX) for n in names)


class AdapterMerger:
    """Applies adapter versions to a plain HF module (an engine's own copy) by merging them into its weights:
    ``W = W0 + scale * B @ A`` for every adapted linear layer, ``W0`` kept as a copy of the targeted weights only
    (taken at the first version), so that decoding runs the plain module at full speed. Modules trained fully
    (``modules_to_save``) are copied in."""

    def __init__(self, model: Any, scale: float):
        self.model = model
        self.scale = scale
        self.base: dict[str, Any] = {}
        """The targeted layers' base weights, by module name."""

    def apply(self, state: dict[str, Any]) -> None:
        """Merge one adapter version (its whole state: every ``lora_A``/``lora_B`` pair)."""
        import torch

        from relax_hpc.errors import SnapshotError

        modules = dict(self.model.named_modules())
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for key, t in state.items():
                name = key[len(ADAPTER_PREFIX):]
                if name.endswith(".lora_B.weight"):
                    continue
                if name.endswith(".lora_A.weight"):
                    path = name[: -len(".lora_A.weight")]
                    b = state.get(f"{ADAPTER_PREFIX}{path}.lora_B.weight")
                    if path not in modules or b is None:
                        raise SnapshotError(f"adapter tensor {key!r} fits no layer of the model (or lacks lora_B)")
                    w = modules[path].weight
                    w0 = self.base.setdefault(path, w.detach().clone())
                    delta = b.to(w.device, torch.float32) @ t.to(w.device, torch.float32)
                    w.copy_((w0.float() + self.scale * delta).to(w.dtype))
                elif name in params:
                    params[name].copy_(t.to(params[name].device, params[name].dtype))
                else:
                    raise SnapshotError(f"adapter tensor {key!r} fits no parameter of the model")


def adapter_template(model: Any, cfg: LoraConfig) -> dict[str, Any]:
    """Empty tensors named and shaped like the adapter's state that :func:`apply_lora` with ``cfg`` gives ``model``
    (PEFT's file names; the fast path's receive buffers of an engine that merges adapters)."""
    import torch

    out: dict[str, Any] = {}
    saved = set(cfg.modules_to_save)
    for name, m in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in cfg.target_modules) \
                and last not in saved:
            out[f"{ADAPTER_PREFIX}{name}.lora_A.weight"] = torch.empty(cfg.rank, m.in_features, dtype=m.weight.dtype,
                                                                     device=m.weight.device)
            out[f"{ADAPTER_PREFIX}{name}.lora_B.weight"] = torch.empty(m.out_features, cfg.rank, dtype=m.weight.dtype,
                                                                     device=m.weight.device)
        elif any(name == t or name.endswith("." + t) for t in saved):
            for pname, p in m.named_parameters():
                out[f"{ADAPTER_PREFIX}{name}.{pname}"] = torch.empty_like(p.detach())
    return out
