"""Shared fixtures and the tiers of the test suite.

Tiers are folders: ``unit`` (in-process, seconds), ``integration`` (real processes end to end on the CPU),
``slurm`` (a real Slurm cluster: tools/slurm_local.sh), ``netfs`` (sshfs mounts: tools/netfs.sh), ``gpu`` (a CUDA
GPU). Each test also carries the marker of its folder, so ``-m "not integration"`` and ``tests/unit`` select the
same thing; helpers shared by several test modules live in ``tests/helpers`` (never imported from a test module).

Under pytest-xdist (``-n N --dist loadgroup``, as tools/test.sh runs the suite) a module's tests stay on one worker,
so module-scoped fixtures (a started vLLM server, a Slurm run) start once; the ``slurm`` and ``netfs`` tiers share
one worker, so their jobs never queue behind each other on the small local cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_hpc.rundir import RunDir

TIER_MARKS = {"integration": "integration", "slurm": "slurm", "netfs": "netfs", "gpu": "gpu"}


SERIAL_TIERS = {"slurm", "netfs"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath))
        tier = path.parent.name
        mark = TIER_MARKS.get(tier)
        if mark is not None and mark not in item.keywords:
            item.add_marker(getattr(pytest.mark, mark))
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group("cluster" if tier in SERIAL_TIERS else f"{tier}/{path.stem}"))


@pytest.fixture
def rd(tmp_path: Path) -> RunDir:
    """A fresh run directory."""
    return RunDir.create(tmp_path / "run")
