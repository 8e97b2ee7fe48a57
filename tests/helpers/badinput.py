"""Helpers of the bad-input battery: run the real CLI in-process, capture its output, judge the outcome."""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

from relax_hpc.cli import main

MAX_ERROR_LINE = 400
"""An error line longer than this echoes too much of the user's input."""


@dataclass
class Outcome:
    rc: int
    out: str
    err: str

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("error:")]


def run_cli(*argv: str) -> Outcome:
    """``relax-hpc ARGV`` in this process. A traceback (any exception leaving ``main``) fails the calling test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return Outcome(rc, out.getvalue(), err.getvalue())


def assert_one_error(res: Outcome, *needles: str) -> str:
    """Exit 2, exactly one short ``error:`` line, no traceback; the line names every ``needle``."""
    assert res.rc == 2, f"exit {res.rc}, stderr: {res.err[-2000:]}"
    lines = res.error_lines
    assert len(lines) == 1, f"expected one error line, got {len(lines)}: {res.err[-2000:]}"
    assert "Traceback" not in res.err, res.err[-2000:]
    line = lines[0]
    assert len(line) <= MAX_ERROR_LINE, f"error line of {len(line)} chars: {line[:300]}..."
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


def assert_error_or_survived(res: Outcome, *needles: str) -> None:
    """Either the command survived (exit 0) or it gave one clear error line naming ``needles``."""
    if res.rc == 0:
        assert "Traceback" not in res.err, res.err[-2000:]
        return
    assert_one_error(res, *needles)
