"""Built-in synthetic tasks: reverse, sort or copy a string of digits (the demo; no files needed).

A prompt is one instruction letter followed by the digits (``"R" + digits`` reverse, ``"S"`` sort ascending, ``"C"``
copy); the answer is the target digit string, e.g. ``R3071 -> 1703``, ``S3071 -> 0137``, ``C3071 -> 3071``. The
``num_prompts`` digit strings are distinct (leading zeros allowed): each draws a length uniformly from ``[min_len,
max_len]`` then its digits, and repeats are redrawn. They depend only on the task's settings and the seed.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from relax_hpc.config.schema import TaskConfig
from relax_hpc.errors import ConfigError

LETTERS: dict[str, str] = {"reverse_digits": "R", "sort_digits": "S", "copy_digits": "C"}
_TARGETS: dict[str, Callable[[str], str]] = {
    "reverse_digits": lambda d: d[::-1],
    "sort_digits": lambda d: "".join(sorted(d)),
    "copy_digits": lambda d: d,
}


def task_answer(name: str, digits: str) -> str:
    """The target digit string of ``digits`` for task ``name``."""
    return _TARGETS[name](digits)


def _digit_strings(task: TaskConfig, seed: int, where: str) -> list[str]:
    if task.max_len < task.min_len:
        raise ConfigError(f"{where}.max_len={task.max_len} is smaller than min_len={task.min_len}")
    lengths = range(task.min_len, task.max_len + 1)
    space = sum(10**n for n in lengths)
    if task.num_prompts > space:
        raise ConfigError(f"{where}.num_prompts={task.num_prompts}: only {space} distinct digit strings have "
                          f"{task.min_len}..{task.max_len} digits")
    rng = random.Random(f"relax-hpc-task:{task.name}:{task.min_len}:{task.max_len}:{seed}")
    if 2 * task.num_prompts >= space:  # dense: sample from the enumeration (bounded by 2 x num_prompts)
        every = ["".join(p) for n in lengths for p in itertools.product("0123456789", repeat=n)]
        return rng.sample(every, task.num_prompts)
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < task.num_prompts:  # sparse: rejection terminates quickly (at least half the space is free)
        n = rng.choice(lengths)
        s = "".join(rng.choice("0123456789") for _ in range(n))
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def generate_task(task: TaskConfig, seed: int, *, where: str = "data.task") -> list[dict[str, str]]:
    """``num_prompts`` rows ``{"prompt": letter + digits, "answer": target}``, deterministic in ``seed``."""
    letter = LETTERS[task.name]
    return [{"prompt": letter + d, "answer": task_answer(task.name, d)} for d in _digit_strings(task, seed, where)]
