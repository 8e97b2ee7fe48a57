"""Built-in tiny models and the offline ``builtin:digits`` tokenizer (for tests and the demo; no network).

The digits tokenizer is a character-level WordLevel tokenizer over ``0-9``, the task letters ``R S C`` (reverse,
sort, copy) and ``=`` (answer separator), plus ``<pad> <bos> <eos> <unk>``. Its chat template renders a
conversation as ``<bos>`` + the user contents, and ``=`` as the generation prompt; the assistant's answer ends with
``<eos>``.
"""

from __future__ import annotations

from typing import Any

from relax_hpc.config.schema import TinyModelConfig

DIGITS_SPECIAL = ["<pad>", "<bos>", "<eos>", "<unk>"]
DIGITS_CHARS = list("0123456789RSC=")
DIGITS_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}={{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] != 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)


def build_digits_tokenizer() -> Any:
    """The offline character-level tokenizer of the demo tasks, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(DIGITS_SPECIAL + DIGITS_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\S"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = DIGITS_CHAT_TEMPLATE
    return fast


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int, *, seed: int = 0, pad_token_id: int = 0,
                     bos_token_id: int | None = None, eos_token_id: int | None = None) -> Any:
    """A small causal LM with random weights made from config (Qwen3 architecture)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if cfg.arch != "qwen3":
        from relax_hpc.errors import ConfigError

        raise ConfigError(f"model.tiny.arch={cfg.arch!r}: the text trainer builds only qwen3 tiny models; "
                          "multimodal tiny models come from relax_hpc.models.multimodal")
    if cfg.hidden_size % cfg.num_heads:
        from relax_hpc.errors import ConfigError

        raise ConfigError(f"model.tiny.hidden_size={cfg.hidden_size} is not divisible by num_heads={cfg.num_heads}")
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads, max_position_embeddings=cfg.max_position,
        tie_word_embeddings=cfg.tie_embeddings, pad_token_id=pad_token_id, bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    return model
