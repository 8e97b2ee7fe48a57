"""A task that needs its tool, small enough for the tiny model and the built-in ``builtin:digits`` tokenizer.

Each episode hides a random secret of ``length`` digits (drawn from the episode's seed: nothing in the prompt
predicts it). The model's turn ``C`` (the parser :class:`DigitCallParser`: a turn starting with ``C``) calls the
``lookup`` tool, which answers with the secret; any other turn is the final answer, rewarded 1 when it equals the
secret (``partial``: the fraction of digits in place). Without the tool the success rate is ``10**-length``.

The rendered episode with the digits template is ``<bos>47=C<eos>39=39<eos>``: prompt, generation prompt ``=``, the
call, the tool's answer (environment tokens, masked), the answer.

Its supervised warm-up (``warmup.source: env``, :meth:`DigitLookupEnv.warmup_examples`) teaches only what comes
after a call: copying the tool's answer (also after a call turn with more after its ``C``, as sampled turns have).
Whether to call is never shown: the first turn is held at uniform over the turns that make sense (ten one-digit
answers and the call ``C``), so calling is exactly as likely as any one answer and RL has to find that it pays.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from relax_hpc.envs.api import Message, Task, ToolCall, WarmupExample
from relax_hpc.envs.parsers import Parsed
from relax_hpc.envs.tool_env import ToolEnvironment

DIGITS = "0123456789"


class DigitCallParser:
    """``C`` at the start of a turn is a call of ``lookup`` with no arguments."""

    def parse(self, text: str) -> Parsed:
        if text.startswith("C"):
            return Parsed(text[1:], [ToolCall("lookup", {})], [])
        return Parsed(text, [], [])


class DigitLookupEnv(ToolEnvironment):
    """Prompt: ``prompt`` digits; the secret: ``length`` random digits per episode; tool: ``lookup()``."""

    def __init__(self, length: int = 1, partial: bool = False):
        if length < 1:
            raise ValueError("length must be >= 1")
        self.length = length
        self.partial = partial

    def tools(self) -> Sequence[Callable[..., Any]]:
        def lookup() -> str:
            """Return the secret digits of this episode."""
            return self.secret

        return [lookup]

    def first_messages(self, task: Task) -> list[Message]:
        rng = random.Random(f"{self.seed}:{task.prompt}")
        self.secret = "".join(rng.choice("0123456789") for _ in range(self.length))
        return [{"role": "user", "content": str(task.prompt)}]

    def warmup_examples(self, task: Task, rng: random.Random) -> list[WarmupExample]:
        """One reading example (a call turn, a random tool answer, the answer copied) and the eleven first turns
        (ten digits and ``C``), each weighted 1/11: cross-entropy of the first turn to uniform over them."""
        first = [{"role": "user", "content": str(task.prompt)}]
        answer = "".join(rng.choice(DIGITS) for _ in range(self.length))
        call = "C" + "".join(rng.choice(DIGITS + "=C") for _ in range(rng.randrange(3)))
        read = [*first, {"role": "assistant", "content": call}, {"role": "tool", "content": answer}]
        turns = [*DIGITS, "C"]
        return [WarmupExample(read, answer), *(WarmupExample(first, t, 1 / len(turns)) for t in turns)]

    def score(self, answer: str) -> float:
        if self.partial:
            return sum(a == b for a, b in zip(answer, self.secret)) / self.length
        return float(answer == self.secret)
