"""Built-in rewards against hand-made cases."""

from __future__ import annotations

import os
import textwrap
import threading
from pathlib import Path

import pytest

from relax_hpc.rewards.builtin import digits_positional, exact_match, format_check, last_boxed, math_answer


def test_exact_match_strips_and_optionally_ignores_case():
    assert exact_match("  42\n", "42") == 1.0
    assert exact_match("42", 42) == 1.0
    assert exact_match("Paris", "paris") == 0.0
    assert exact_match(" Paris ", "paris", ignore_case=True) == 1.0
    assert exact_match("4 2", "42") == 0.0


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        (r"so the total is \boxed{42}.", "42", 1.0),
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"The answer is 0.5", r"\frac{1}{2}", 1.0),
        (r"first \boxed{2}, no wait: \boxed{3}", "3", 1.0),  # the last box counts
        (r"first \boxed{3}, no wait: \boxed{2}", "3", 0.0),
        (r"\boxed{1+x}", "x+1", 1.0),
        ("she has 72 apples left", "Half of 144 is 72.\n#### 72", 1.0),  # GSM8K-style gold
        ("3 then 72 then 5", "72", 0.0),  # without a box the final number counts
        (r"\boxed{41}", "42", 0.0),
        (r"\boxed{hello}", "hello", 1.0),  # math-verify cannot parse it: exact-match fallback
        (r"\boxed{hello}", "world", 0.0),
        ("no answer at all", "7", 0.0),
        ("blah 3. " * 2000 + "So the answer is 7.", "7", 1.0),  # only the tail of a long response is parsed
        (r"cut off \boxed{4", "4", 0.0),
    ],
)
def test_math_answer(response, answer, expected):
    assert math_answer(response, answer) == expected


def test_math_answer_works_off_the_main_thread():
    """math-verify's signal-based timeout only works in the main thread; off it the reward still scores."""
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(math_answer(r"\boxed{12}", "12")))
    t.start()
    t.join(60)
    assert out == [1.0]


def test_last_boxed_balances_braces():
    assert last_boxed(r"x \boxed{\frac{a}{b}} y") == r"\frac{a}{b}"
    assert last_boxed(r"\fbox{1} \boxed{2}") == "2"
    assert last_boxed("none") is None


def test_format_check_default_and_custom_pattern():
    assert format_check("<think>hmm</think>\n<answer>4</answer>", None) == 1.0
    assert format_check("<answer>4</answer>", None) == 0.0
    assert format_check("<think>a</think><answer>4</answer> trailing", None) == 0.0
    assert format_check("abc123", None, pattern=r"[a-z]+\d+") == 1.0
    assert format_check("xx abc123 yy", None, pattern=r"[a-z]+\d+") == 0.0
    assert format_check("xx abc123 yy", None, pattern=r"[a-z]+\d+", search=True) == 1.0


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("54321", "54321", 1.0),
        ("54321<eos>", "54321", 1.0),
        ("5432", "54321", 4 / 5),  # a missing digit costs like a wrong one
        ("543210", "54321", 5 / 6),  # so does an extra one
        ("14325", "54321", 3 / 5),
        (" 54 321", "54321", 1.0),  # spaces between digits are ignored
        ("54x321", "54321", 2 / 5),  # the first other character ends the digits
        ("\n54321", "54321", 1.0),  # leading whitespace is skipped
        ("", "54321", 0.0),
        ("abc", "123", 0.0),
        ("", "", 1.0),
    ],
)
def test_digits_positional(response, answer, expected):
    assert digits_positional(response, answer) == pytest.approx(expected)


def test_math_answer_is_offline_and_spawns_nothing():
    """In a fresh interpreter where sockets, subprocesses and forks raise, importing and using math-verify works."""
    import subprocess
    import sys

    script = textwrap.dedent(r"""
        import os, socket, subprocess, multiprocessing
        def refuse(*a, **k):
            raise AssertionError("math reward tried to use the network or spawn a process")
        socket.socket.connect = socket.socket.connect_ex = refuse
        socket.create_connection = socket.getaddrinfo = refuse
        subprocess.Popen.__init__ = refuse
        os.fork = refuse
        multiprocessing.Process.start = refuse
        from relax_hpc.rewards.builtin import math_answer
        assert math_answer(r"\boxed{\frac{1}{2}}", "0.5") == 1.0
        assert math_answer("the answer is 3", "4") == 0.0
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
