"""Fixtures of the integration tier: an event loop on its own thread for a module's server engine (an engine and
its HTTP client live in one loop across the tests of a module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.server_util import LoopThread


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()
