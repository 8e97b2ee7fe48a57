"""Rewards of the shipped multimodal examples: multiple choice, and boxed answers with a format term (geometry-style).

Both take the response text and the row's answer; both are deterministic and need no model.
"""

from __future__ import annotations

import re
from typing import Any

from relax_hpc.data.answers import last_boxed

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def _choice_in(text: str, choices: str) -> str | None:
    boxed = last_boxed(text)
    if boxed is not None:
        text = boxed
    m = re.search(rf"(?<![A-Za-z])([{re.escape(choices)}])(?![A-Za-z])", text)
    return m.group(1) if m else None


def multiple_choice(response: str, answer: Any, *, choices: str = "ABCD") -> float:
    """1.0 if the first stand-alone choice letter of the response (inside its last ``\\boxed{}`` when it has one)
    is the answer letter (the answer may be ``"B"``, ``"(B)"`` or ``"B) second"``), else 0.0."""
    gold = _choice_in(str(answer), choices)
    return float(gold is not None and _choice_in(response, choices) == gold)


def _as_number(text: str) -> float | None:
    m = _NUMBER.fullmatch(text.strip().replace(",", "").rstrip("."))
    if m is None:
        return None
    num, _, den = m.group(0).partition("/")
    try:
        return float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        return None


def _same(pred: str, gold: str) -> bool:
    a, b = _as_number(pred), _as_number(gold)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))
    return pred.strip().replace(" ", "") == gold.strip().replace(" ", "")


def boxed_answer(response: str, answer: Any, *, format_weight: float = 0.1) -> float:
    """Geometry-style score in [0, 1]: ``(1 - format_weight) * correct + format_weight * formatted``. ``formatted``:
    the response puts an answer in ``\\boxed{}``; ``correct``: that answer (without a box: the last number of the
    response) equals the reference (numbers compared as numbers, ``a/b`` fractions too; the reference may itself be
    boxed)."""
    gold = str(answer)
    gold = last_boxed(gold) or gold
    boxed = last_boxed(response)
    if boxed is None:
        nums = _NUMBER.findall(response)
        pred = nums[-1] if nums else None
    else:
        pred = boxed
    correct = pred is not None and _same(pred, gold)
    return (1.0 - format_weight) * float(correct) + format_weight * float(boxed is not None)
