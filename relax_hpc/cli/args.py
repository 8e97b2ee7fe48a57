"""Argument types and the parser class of the CLI: every bad flag is one ``error:`` line and exit code 2."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from typing import NoReturn

MAX_SECONDS = 30 * 86_400.0
"""Longest duration any flag takes (30 days): ``inf`` is a typo, not a wish."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line ``error: ...`` on stderr (no usage block), exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(2)


def seconds(*, allow_zero: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number of wall-clock seconds, > 0 (>= 0 with ``allow_zero``), <= 30 days."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number of seconds") from None
        low_ok = value >= 0 if allow_zero else value > 0
        if not math.isfinite(value) or not low_ok or value > MAX_SECONDS:
            bound = ">= 0" if allow_zero else "> 0"
            raise argparse.ArgumentTypeError(f"{text[:40]!r}: seconds must be finite, {bound} and at most "
                                             f"{MAX_SECONDS:.0f}")
        return value

    parse.__name__ = "seconds"
    return parse
