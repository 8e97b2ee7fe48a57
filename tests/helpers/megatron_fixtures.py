"""Shared by the megatron test modules that build a backend in-process (import the fixture to use it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module", autouse=True)
def megatron_process_group() -> Iterator[None]:
    """The backend makes an in-process gloo group and megatron's parallel state: gone after the module."""
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
