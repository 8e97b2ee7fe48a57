"""A guessing game with feedback: the environment holds a secret number, the model guesses, the environment says
``higher``, ``lower`` or ``correct``. Reward 1 for the correct guess (``turn_penalty`` less for each extra turn),
0 if the turns run out. Feedback comes as user messages, so templates that drop earlier reasoning at a new user
message are not prefix-preserving here (each such turn starts a new sample)."""

from __future__ import annotations

import random
import re

from relax_hpc.envs.api import AssistantTurn, Environment, Message, Step, Task

_INT = re.compile(r"-?\d+")


class GuessNumberEnv(Environment):
    """Guess an integer in ``[low, high]``."""

    def __init__(self, low: int = 1, high: int = 100, turn_penalty: float = 0.05, use_answer: bool = False,
                 prompt: str | None = None, higher: str = "{guess} is wrong: higher.",
                 lower: str = "{guess} is wrong: lower.", not_a_number: str = "Answer with a number."):
        """``use_answer``: the secret is the task's answer (else drawn from the episode's seed; the task's prompt is
        then not shown). ``prompt``, ``higher``, ``lower``, ``not_a_number``: the texts the model reads (a tiny
        tokenizer needs texts in its vocabulary)."""
        if low >= high:
            raise ValueError(f"low={low} must be below high={high}")
        self.low, self.high, self.turn_penalty, self.use_answer = low, high, turn_penalty, use_answer
        self.prompt = prompt or (f"I am thinking of a number between {low} and {high}. Guess it; answer with the "
                                 "number only.")
        self.texts = {"higher": higher, "lower": lower, "nan": not_a_number}

    async def reset(self, task: Task, seed: int) -> list[Message]:
        rng = random.Random(f"{seed}:{task.prompt}")
        self.secret = int(task.answer) if self.use_answer else rng.randint(self.low, self.high)
        self.turns = 0
        return [{"role": "user", "content": self.prompt}]

    async def step(self, turn: AssistantTurn) -> Step:
        self.turns += 1
        found = _INT.findall(turn.content.split("</think>")[-1])
        if not found:
            return Step([{"role": "user", "content": self.texts["nan"]}], 0.0, False)
        guess = int(found[-1])
        if guess == self.secret:
            return Step([], max(0.0, 1.0 - self.turn_penalty * (self.turns - 1)), True, {"guesses": self.turns})
        hint = self.texts["higher" if guess < self.secret else "lower"]
        return Step([{"role": "user", "content": hint.format(guess=guess)}], 0.0, False)
