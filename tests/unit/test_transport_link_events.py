"""The events a worker's weight receiver logs when its fast path stops serving
(relax_hpc.weights.transport.files.SyncReceiver): a fallback mid-run is a warning, the trainer closing the link at
the end of the run (STATUS.json written before the link closes) is not."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from relax_hpc.fsio import atomic_write_json
from relax_hpc.rundir import RunDir
from relax_hpc.weights.transport.files import SyncReceiver


@dataclass
class _Sync:
    run_dir: RunDir
    results: list[int | None]
    fast: object = True

    def newest(self) -> int:
        return 3

    async def pull_fast(self) -> int | None:
        return self.results.pop(0)


@dataclass
class _Events:
    got: list[tuple[str, str]] = field(default_factory=list)

    def event(self, name: str, message: str, level: str = "info", **_: Any) -> None:
        self.got.append((name, level))


def _pulls(rd: RunDir, results: list[int | None], *, finished_after: int) -> list[tuple[str, str]]:
    events = _Events()
    recv = SyncReceiver("process_group", _Sync(rd, list(results)), events)  # type: ignore[arg-type]
    for i in range(len(results)):
        if i == finished_after:
            atomic_write_json(rd.status_file, {"state": "completed"})
        asyncio.run(recv.pull())
    return events.got


def test_a_link_lost_mid_run_is_a_fallback_warning_and_its_return_is_logged(rd: RunDir) -> None:
    got = _pulls(rd, [1, None, 2], finished_after=99)
    assert got == [("weight_fast_path_back", "info"), ("weight_fallback", "warning"),
                   ("weight_fast_path_back", "info")]


def test_a_link_closed_at_the_end_of_the_run_is_no_warning(rd: RunDir) -> None:
    got = _pulls(rd, [1, 2, None], finished_after=2)
    assert got == [("weight_fast_path_back", "info"), ("weight_link_closed", "info")]
