"""``models.load.decode_texts``: one batch decode gives the texts that decoding each sequence does, with and without
special tokens, for the digits tokenizer and the real Qwen vocabulary; a tokenizer that asks for the clean-up of
spaces (or has no fast backend) decodes one by one."""

from __future__ import annotations

import numpy as np
import pytest

from relax_hpc.models.load import decode_texts
from relax_hpc.models.qwen_vocab import qwen_tokenizer_dir
from relax_hpc.models.tiny import build_digits_tokenizer


def qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


@pytest.mark.parametrize("build", [build_digits_tokenizer, qwen_tokenizer], ids=["digits", "qwen"])
@pytest.mark.parametrize("skip", [True, False])
def test_batch_decode_equals_one_by_one(build, skip: bool) -> None:
    tok = build()
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, len(tok), int(rng.integers(0, 12))).astype(np.int32) for _ in range(64)]
    seqs.append(np.asarray([*tok("Hello, world! 12 + 30 = 42").input_ids, tok.eos_token_id], dtype=np.int64))
    want = [tok.decode(s, skip_special_tokens=skip) for s in seqs]
    assert decode_texts(tok, seqs, skip_special_tokens=skip) == want
    assert decode_texts(tok, [s.tolist() for s in seqs], skip_special_tokens=skip) == want
    assert any(w != "" for w in want)


class OneByOne:
    """A tokenizer without a fast backend; it records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        self.calls.append(list(ids))
        return ",".join(map(str, ids)) + ("" if skip_special_tokens else "!")


def test_tokenizers_without_a_batch_path_decode_one_by_one() -> None:
    tok = OneByOne()
    assert decode_texts(tok, [[1, 2], [3]]) == ["1,2", "3"]
    assert tok.calls == [[1, 2], [3]]
    digits = build_digits_tokenizer()
    ids = digits("1 2 3").input_ids
    want = digits.decode(ids, skip_special_tokens=True)
    calls: list[object] = []
    one = digits.decode
    digits.decode = lambda s, **kw: calls.append(s) or one(s, **kw)
    assert decode_texts(digits, [ids, ids]) == [want, want] and calls == []  # the batch path
    digits.clean_up_tokenization_spaces = True  # the fast tokenizer's own clean-up must still run: one by one
    assert decode_texts(digits, [ids, ids]) == [want, want] and len(calls) == 2


_THREADS = """
import os, sys
from relax_hpc.config.schema import ModelConfig
from relax_hpc.models.load import decode_texts, load_tokenizer
tok = load_tokenizer(ModelConfig(path="tiny"))
before = len(os.listdir("/proc/self/task"))
for _ in range(20):
    decode_texts(tok, [[3, 4, 5, 6, 7, 8]] * 256)
print(os.environ["TOKENIZERS_PARALLELISM"], len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.parametrize("setting", [None, "true"])
def test_roles_tokenizer_starts_no_thread_pool_unless_asked(setting: str | None) -> None:
    """``load_tokenizer`` turns the tokenizers library's thread pool off (its threads spin beside the trainer's after
    every batch call), unless the user set ``TOKENIZERS_PARALLELISM``: then their setting is kept."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    if setting is not None:
        env["TOKENIZERS_PARALLELISM"] = setting
    out = subprocess.run([sys.executable, "-c", _THREADS], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    if setting is None:
        assert out == ["false", "0"]
    else:
        assert out[0] == "true" and int(out[1]) >= 1  # the library's pool: the check above can see threads
