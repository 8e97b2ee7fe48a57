"""Write the two-digit addition data of recipes/smollm2-135m-arithmetic*.yaml (deterministic, no downloads):

    python recipes/data/make_addition.py

* ``addition-train.jsonl``: 3000 additions ``a + b`` with ``10 <= a, b <= 99``;
* ``addition-heldout.jsonl``: 200 other additions (no pair, and no prompt, is in both files), the held-out set of
  the recipes' ``eval`` section.

Each row: ``{"prompt": "47 + 38 =", "answer": "85", "data_source": "carry" | "no_carry"}`` (whether the ones digits
carry: the evaluation reports accuracy per source). The bare equation, in the chat template with its default system
prompt, is the form SmolLM2-135M-Instruct answers briefly ("The answer is: 85"); "What is 47 + 38?" makes it explain
at length ("To add 47 and 38, we need ..."), past a CPU-sized token budget.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN, HELDOUT = 3000, 200


def row(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"{a} + {b} =", "answer": str(a + b),
            "data_source": "carry" if a % 10 + b % 10 >= 10 else "no_carry"}


def main() -> None:
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(20261204).shuffle(pairs)
    held, train = pairs[:HELDOUT], pairs[HELDOUT:HELDOUT + TRAIN]
    assert not {row(*p)["prompt"] for p in held} & {row(*p)["prompt"] for p in train}
    for name, rows in (("addition-heldout.jsonl", held), ("addition-train.jsonl", train)):
        (HERE / name).write_text("".join(json.dumps(row(a, b)) + "\n" for a, b in rows))
        print(f"wrote {HERE / name} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
