"""Write ``arithmetic.jsonl``: short arithmetic word problems with integer answers, for text math recipes and tests.

Each line is ``{"prompt": str, "answer": str, "op": str}``; the answer is the final number (score it with the
``math`` reward). Deterministic: ``python recipes/data/make_arithmetic.py [--n 200] [--seed 0] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jia", "Kofi", "Lena"]
THINGS = ["apples", "books", "coins", "marbles", "stamps", "pencils", "shells", "cards"]


def _problem(rng: random.Random) -> dict[str, str]:
    name, other = rng.sample(NAMES, 2)
    thing = rng.choice(THINGS)
    op = rng.choice(["add", "sub", "mul", "div", "two_step"])
    if op == "add":
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        text = f"{name} has {a} {thing} and gets {b} more from {other}. How many {thing} does {name} have now?"
        ans = a + b
    elif op == "sub":
        a = rng.randint(10, 120)
        b = rng.randint(1, a - 1)
        text, ans = f"{name} has {a} {thing} and gives {b} of them to {other}. How many {thing} are left?", a - b
    elif op == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 25)
        text, ans = f"{name} fills {a} boxes with {b} {thing} each. How many {thing} is that in total?", a * b
    elif op == "div":
        b, q = rng.randint(2, 12), rng.randint(2, 20)
        text, ans = (f"{name} shares {b * q} {thing} equally among {b} friends. How many {thing} does each friend "
                     "get?"), q
    else:
        a, b = rng.randint(2, 9), rng.randint(2, 15)
        c = rng.randint(1, min(30, a * b - 1))
        text, ans = (f"{name} buys {a} packs of {b} {thing} and then loses {c} of them. How many {thing} does "
                     f"{name} have?"), a * b - c
    return {"prompt": text, "answer": str(ans), "op": op}


def make(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` distinct problems, deterministic in ``seed``."""
    rng = random.Random(f"arithmetic:{seed}")
    seen: set[str] = set()
    out = []
    while len(out) < n:
        p = _problem(rng)
        if p["prompt"] not in seen:
            seen.add(p["prompt"])
            out.append(p)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("arithmetic.jsonl"))
    args = ap.parse_args()
    lines = [json.dumps(p) for p in make(args.n, args.seed)]
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} problems to {args.out}")


if __name__ == "__main__":
    main()
