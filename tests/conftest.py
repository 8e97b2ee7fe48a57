"""Shared fixtures and the tiers of the test suite.

Tiers are folders: ``unit`` (in-process, seconds), ``integration`` (real processes end to end on the CPU),
``slurm`` (a real Slurm cluster: tools/slurm_local.sh), ``netfs`` (sshfs mounts: tools/netfs.sh), ``gpu`` (a CUDA
GPU). Each test also carries the marker of its folder, so ``-m "not integration"`` and ``tests/unit`` select the
same thing; helpers shared by several test modules live in ``tests/helpers`` (never imported from a test module).

Under pytest-xdist (``-n N --dist loadgroup``, as tools/test.sh runs the suite) a module's tests stay on one worker,
so module-scoped fixtures (a started vLLM server, a Slurm run) start once; the ``slurm`` tier runs on one worker, so
its jobs never queue behind each other on the small local cluster, and the ``netfs`` tier on one other.

Several tests at once share few cores: OpenMP threads that spin while they wait for work (libgomp's default) take
the cores from the other tests' processes (three 2-thread torch processes on 2 cores ran 11x slower than with
``OMP_WAIT_POLICY=PASSIVE``). Under xdist every process of the suite gets ``OMP_WAIT_POLICY=PASSIVE`` and one
OpenMP thread unless the environment says otherwise (set here, before torch is imported, so children inherit it).
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from relax_hpc.rundir import RunDir

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

TIER_MARKS = {"integration": "integration", "slurm": "slurm", "netfs": "netfs", "gpu": "gpu"}


SERIAL_TIERS = {"slurm", "netfs"}
"""Tiers whose tests all run on one worker (one group per tier), ahead of the others."""


KNOWN_FAILING: dict[str, str] = {}
"""Conformance-suite tests (defined in tests/helpers) known to fail in one engine's module, with the reason."""

COSTS = Path(__file__).with_name("group_costs.json")
"""Wall seconds of each xdist group in a measured run of the suite (``python tools/test_times.py FILE --write``)."""
TIER_COST = {"integration": 60.0, "gpu": 1.0, "unit": 5.0}
"""The cost of a group not in COSTS, by tier. The serial tiers' groups always go first."""


def _group(path: Path) -> str:
    tier = path.parent.name
    return tier if tier in SERIAL_TIERS else f"{tier}/{path.stem}"


def _costs() -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(COSTS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath))
        mark = TIER_MARKS.get(path.parent.name)
        if mark is not None and mark not in item.keywords:
            item.add_marker(getattr(pytest.mark, mark))
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(_group(path)))
    for item in items:  # suite tests run from tests/helpers, marked where they fail in one module only
        if item.nodeid.split("@")[0] in KNOWN_FAILING:
            item.add_marker(pytest.mark.xfail(strict=False, reason=KNOWN_FAILING[item.nodeid.split("@")[0]]))
    _longest_first(items)


def _longest_first(items: list[pytest.Item]) -> None:
    """Order the groups by cost, the costliest first (tools/test.sh runs xdist with ``--no-loadscope-reorder``, so
    groups are handed out in this order): the long groups start at once instead of trailing the run, and the many
    short ones fill the workers at the end. The 4th group is the cheapest: xdist queues it behind the first."""
    costs = _costs()

    def cost(item: pytest.Item) -> float:
        path = Path(str(item.fspath))
        if path.parent.name in SERIAL_TIERS:
            return float("inf")
        return costs.get(_group(path), TIER_COST.get(path.parent.name, 1.0))

    order: dict[str, float] = {}
    for item in items:
        order.setdefault(_group(Path(str(item.fspath))), cost(item))
    ranked = sorted(order, key=lambda g: -order[g])
    if len(ranked) > 4:
        ranked.insert(3, ranked.pop())
    rank = {g: i for i, g in enumerate(ranked)}
    items.sort(key=lambda it: rank[_group(Path(str(it.fspath)))])


@pytest.fixture
def rd(tmp_path: Path) -> RunDir:
    """A fresh run directory."""
    return RunDir.create(tmp_path / "run")


_OUTCOMES: dict[str, str] = {}
"""The outcome of each phase of a test that did not pass (``failed``, ``skipped``), for the times log."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.outcome != "passed" and report.nodeid not in _OUTCOMES:
        _OUTCOMES[report.nodeid] = f"{report.outcome} ({report.when})"


def _cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """With ``RELAX_TEST_TIMES=FILE``, one JSON line per test: wall seconds and CPU seconds (this process and the
    children it reaped: the roles a test's launcher ran), which, unlike wall time, a loaded machine does not
    inflate much. ``python tools/test_times.py FILE`` sums them by module and by xdist group."""
    out = os.environ.get("RELAX_TEST_TIMES")
    if not out:
        yield
        return
    t0, c0 = time.monotonic(), _cpu_seconds()
    yield
    rec = {"test": item.nodeid, "wall_s": round(time.monotonic() - t0, 2), "cpu_s": round(_cpu_seconds() - c0, 2),
           "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "end": round(time.time(), 1),
           "outcome": _OUTCOMES.pop(item.nodeid, "passed")}
    with open(out, "a") as f:
        f.write(json.dumps(rec) + "\n")
