"""Load the policy (and tokenizer) a recipe names: ``tiny`` or an HF model folder / hub name."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from relax_hpc.config.schema import ModelConfig
from relax_hpc.errors import UserError

log = logging.getLogger(__name__)


def resolve_device(want: str) -> str:
    """``auto`` -> cuda when available else cpu; ``cuda`` on a machine without a GPU is a user error."""
    import torch

    if want == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise UserError("a GPU was requested (device: cuda) but this machine has no CUDA device")
    return want


def resolve_dtype(want: str, device: str) -> Any:
    import torch

    if want == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[want]


def _is_local(path: str) -> bool:
    p = Path(path).expanduser()
    return p.exists() or path.startswith((".", "/", "~")) or path.count("/") != 1


def load_tokenizer(cfg: ModelConfig) -> Any:
    """The tokenizer named by ``model.tokenizer`` (default: ``model.path``; ``builtin:digits`` for tiny).

    Also turns off the tokenizers library's own thread pool for this process (``TOKENIZERS_PARALLELISM=false``
    unless set): a batch call (``decode_batch`` of a step's responses, ``encode_batch``) otherwise wakes one thread
    per core that keeps spinning after the call, beside the role's torch threads (measured on the CPU demo: two such
    threads preempted ~400 times a second, and the training phase that followed slower). A batch call runs on the
    calling thread then, which was also faster for a step's short responses (0.078 against 0.096 ms for 128)."""
    import os

    from relax_hpc.models.tiny import build_digits_tokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    default = "builtin:digits" if cfg.tiny.arch == "qwen3" else "builtin:bpe"
    name = cfg.tokenizer or (default if cfg.path == "tiny" else cfg.path)
    if name == "builtin:digits":
        return build_digits_tokenizer()
    if name == "builtin:bpe":
        from relax_hpc.models.multimodal import build_tiny_bpe_tokenizer

        return build_tiny_bpe_tokenizer()
    if _is_local(name) and not Path(name).expanduser().exists():
        raise UserError(f"tokenizer path {name} does not exist")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(Path(name).expanduser()) if _is_local(name) else name,
                                            trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise UserError(f"cannot load tokenizer {name!r}: {str(exc).splitlines()[0]}") from exc
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def decode_texts(tokenizer: Any, sequences: Any, *, skip_special_tokens: bool = True) -> list[str]:
    """``[tokenizer.decode(s, skip_special_tokens=...) for s in sequences]``, in one call of the fast tokenizer's
    ``decode_batch`` where that is the same text (no clean-up of spaces asked for): a quarter of the time on a batch
    of short responses. Other tokenizers decode one by one."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode_batch") or getattr(tokenizer, "clean_up_tokenization_spaces",
                                                                           True):
        return [tokenizer.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]
    lists = [s.tolist() if hasattr(s, "tolist") else list(s) for s in sequences]
    return list(backend.decode_batch(lists, skip_special_tokens=skip_special_tokens))


def load_model(cfg: ModelConfig, tokenizer: Any, *, device: str, dtype: Any, seed: int | None = None) -> Any:
    """The policy model on ``device`` in ``dtype``. ``tiny`` builds random weights from ``cfg.tiny``."""
    if cfg.path == "tiny" and cfg.tiny.arch != "qwen3":
        from relax_hpc.models.multimodal import build_tiny_multimodal_model

        model = build_tiny_multimodal_model(cfg.tiny, tokenizer, seed=cfg.init_seed if seed is None else seed)
    elif cfg.path == "tiny":
        from relax_hpc.models.tiny import build_tiny_model

        model = build_tiny_model(cfg.tiny, len(tokenizer), seed=cfg.init_seed if seed is None else seed,
                                 pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
    else:
        if _is_local(cfg.path) and not Path(cfg.path).expanduser().exists():
            raise UserError(f"model path {cfg.path} does not exist")
        src = str(Path(cfg.path).expanduser()) if _is_local(cfg.path) else cfg.path
        try:
            model = _auto_class(src, cfg.trust_remote_code).from_pretrained(
                src, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
        except OSError as exc:
            raise UserError(f"cannot load model {cfg.path!r}: {str(exc).splitlines()[0]}") from exc
    model.to(device=device, dtype=dtype)
    attn = cfg.attn_implementation
    if attn == "auto":
        attn = "sdpa"
    if attn != getattr(model.config, "_attn_implementation", None):
        model.set_attn_implementation(attn)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if str(device).startswith("cuda"):  # one fused kernel per RMSNorm (models/fused.py)
        from relax_hpc.models.fused import fuse_rms_norms

        fuse_rms_norms(model)
    return model


def _auto_class(src: str, trust_remote_code: bool) -> Any:
    """The transformers class that loads this model: vision-language and audio models are not plain causal LMs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = AutoConfig.from_pretrained(src, trust_remote_code=trust_remote_code).model_type
    if model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    if model_type == "qwen2_audio":
        from transformers import Qwen2AudioForConditionalGeneration

        return Qwen2AudioForConditionalGeneration
    if model_type in ("qwen2_5_omni", "qwen2_5_omni_thinker"):  # the thinker: text out; no talker, no speech
        from transformers import Qwen2_5OmniThinkerForConditionalGeneration

        return Qwen2_5OmniThinkerForConditionalGeneration
    if model_type in ("qwen3_omni_moe", "qwen3_omni_moe_thinker"):
        from transformers import Qwen3OmniMoeThinkerForConditionalGeneration

        return Qwen3OmniMoeThinkerForConditionalGeneration
    return AutoModelForCausalLM
