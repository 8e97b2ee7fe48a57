"""Test environment for the kill/resume tests: the built-in ``digit_lookup`` task whose tool answers after
``delay_s`` (so episodes are in flight for a while), leaving a marker file ``<marker_dir>/<pid>.<n>`` from
``reset`` to ``close``: a test can see that the rollout worker ``pid`` has episodes in flight right now."""

from __future__ import annotations

import asyncio
import itertools
import os
from pathlib import Path

from relax_hpc.envs.api import AssistantTurn, Message, Step, Task
from relax_hpc.envs.builtin.lookup import DigitLookupEnv

_COUNT = itertools.count()


class SlowDigitLookupEnv(DigitLookupEnv):
    def __init__(self, length: int = 1, delay_s: float = 0.2, marker_dir: str = ""):
        super().__init__(length)
        self.delay_s = delay_s
        self.marker_dir = marker_dir
        self.marker: Path | None = None

    async def reset(self, task: Task, seed: int) -> list[Message]:
        if self.marker_dir:
            self.marker = Path(self.marker_dir) / f"{os.getpid()}.{next(_COUNT)}"
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.touch()
        return await super().reset(task, seed)

    async def step(self, turn: AssistantTurn) -> Step:
        await asyncio.sleep(self.delay_s)
        return await super().step(turn)

    async def close(self) -> None:
        if self.marker is not None:
            self.marker.unlink(missing_ok=True)
