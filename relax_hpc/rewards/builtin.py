"""Built-in reward functions (registered by name in :mod:`relax_hpc.rewards.registry`).

All are single, sync functions ``f(response, answer, **kwargs) -> float`` with keyword-only options that the
recipe's ``reward.kwargs`` may set.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from relax_hpc.data.answers import last_boxed


def exact_match(response: str, answer: Any, *, ignore_case: bool = False) -> float:
    """1.0 if the response equals the answer after stripping surrounding whitespace (and case with
    ``ignore_case``), else 0.0. A non-string answer is compared as ``str(answer)``."""
    a, b = response.strip(), str(answer).strip()
    if ignore_case:
        a, b = a.casefold(), b.casefold()
    return float(a == b)


def _gold_text(answer: Any) -> str:
    """The reference answer as text; a GSM8K-style solution keeps only what follows ``####``."""
    text = str(answer).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    return text


def math_answer(response: str, answer: Any, *, timeout_s: int = 5, tail_chars: int = 2000) -> float:
    r"""1.0 if the response's final answer is mathematically equal to the reference answer, else 0.0.

    The final answer is the content of the response's last ``\boxed{}``; without one, math-verify's own extraction
    of a final answer from the response's last ``tail_chars`` characters (the last number or LaTeX expression,
    ``the answer is ...``; the tail bounds the parsing cost of long responses). Both sides are parsed and compared
    with math-verify (numeric, symbolic, set and interval equality). When either side cannot be parsed, the
    stripped strings are compared exactly instead. math-verify works offline and uses
    ``signal.alarm`` for its ``timeout_s`` (whole seconds) in the main thread; in any other thread it runs without a
    timeout (``signal`` only works in the main thread).
    """
    from math_verify import parse, verify

    timeout = int(timeout_s) if threading.current_thread() is threading.main_thread() and timeout_s > 0 else None
    gold_text = _gold_text(answer)
    boxed = last_boxed(response)
    pred_text = boxed.strip() if boxed is not None else response.strip()
    gold = parse(gold_text if "$" in gold_text or "\\boxed" in gold_text else f"\\boxed{{{gold_text}}}",
                 parsing_timeout=timeout)
    pred = parse(f"\\boxed{{{pred_text}}}" if boxed is not None else pred_text[-tail_chars:], parsing_timeout=timeout)
    if gold and pred and verify(gold, pred, timeout_seconds=timeout):
        return 1.0
    return float(bool(gold_text) and pred_text == gold_text)


def format_check(response: str, answer: Any = None, *, pattern: str = r"(?s)^\s*<think>.*?</think>\s*<answer>.*?"
                 r"</answer>\s*$", search: bool = False) -> float:
    """1.0 if ``pattern`` (a Python regex) matches the whole response (``re.fullmatch``; ``search=True``: anywhere,
    ``re.search``), else 0.0. The default pattern asks for ``<think>...</think><answer>...</answer>``. The answer is
    ignored."""
    rx = _compiled(pattern)
    return float((rx.search(response) if search else rx.fullmatch(response)) is not None)


_PATTERNS: dict[str, re.Pattern[str]] = {}


def _compiled(pattern: str) -> re.Pattern[str]:
    rx = _PATTERNS.get(pattern)
    if rx is None:
        rx = _PATTERNS[pattern] = re.compile(pattern)
    return rx


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(response: str, answer: Any) -> float:
    """1.0 if the last number written in the response equals the reference number, else 0.0.

    For short arithmetic answers ("The answer is: 85.", "47 + 38 = 85"). Unlike ``math``, nothing in the response is
    evaluated: math-verify reads a response that only restates the question ("To calculate 47 + 38, we simply") as the
    expression ``47 + 38`` and scores it correct; here its last number is 38, which is wrong. The reference may be a
    GSM8K-style solution (the part after ``####``) and may hold thousands separators.
    """
    found = _NUMBER.findall(response)
    if not found:
        return 0.0
    try:
        return float(float(found[-1]) == float(_gold_text(answer).replace(",", "")))
    except ValueError:
        return 0.0


def digits_positional(response: str, answer: Any) -> float:
    """Positional digit accuracy, the demo tasks' reward, in [0, 1].

    Let ``a`` be the answer's digit string (``str(answer)`` stripped) and ``r`` the response's leading digits: skip
    leading whitespace, then take characters while each is a digit or a space, and drop the spaces; the first other
    character ends ``r`` (so ``" 12 3x45"`` gives ``"123"``). Then::

        score = #{i < min(len(a), len(r)) : a[i] == r[i]} / max(len(a), len(r))

    so a missing or extra digit costs like a wrong one; an empty ``r`` and an empty ``a`` score 1.0, an empty
    ``r`` against a non-empty ``a`` 0.0.
    """
    a = str(answer).strip()
    r = []
    for ch in response.lstrip():
        if ch.isdigit() and ch.isascii():
            r.append(ch)
        elif ch != " ":
            break
    denom = max(len(a), len(r))
    if denom == 0:
        return 1.0
    return sum(x == y for x, y in zip(a, r, strict=False)) / denom
