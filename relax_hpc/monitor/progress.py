"""A progress bar for long local work (the demo, benchmarks, checkpoint export)::

    with progress(len(files), "exporting") as bar:
        for f in files:
            ...
            bar.advance()

On a terminal it is a live rich bar (count, rate, elapsed, ETA); elsewhere (CI logs, pipes) it prints the final
state once when the block ends, so logs are not flooded with redraws.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


class ProgressTask:
    """Handle to one bar: :meth:`advance` it, or :meth:`update` its count or description."""

    def __init__(self, bar: Any, task_id: Any, unit_text: str = "/s"):
        self._bar = bar
        self._id = task_id
        self._unit_text = unit_text

    def advance(self, n: float = 1) -> None:
        self._bar.advance(self._id, n)
        self._show_rate()

    def _show_rate(self) -> None:
        task = self._bar.tasks[self._id]
        speed = task.finished_speed or task.speed
        if speed is None and task.elapsed:
            speed = task.completed / task.elapsed
        self._bar.update(self._id, rate=f"{speed:.3g}{self._unit_text}" if speed else "")

    def update(self, *, completed: float | None = None, total: float | None = None,
               description: str | None = None) -> None:
        kwargs: dict[str, Any] = {}
        if completed is not None:
            kwargs["completed"] = completed
        if total is not None:
            kwargs["total"] = total
        if description is not None:
            kwargs["description"] = description
        self._bar.update(self._id, **kwargs)
        self._show_rate()

    @property
    def completed(self) -> float:
        return float(self._bar.tasks[self._id].completed)

    @property
    def total(self) -> float | None:
        return self._bar.tasks[self._id].total


@contextlib.contextmanager
def progress(total: float | None, description: str, *, console: Any = None, transient: bool = False,
             unit: str = "") -> Iterator[ProgressTask]:
    """A progress bar for ``total`` units of work (None: unknown total, a spinner-like bar without ETA).

    ``console`` defaults to rich's stderr console (stdout stays clean for ``--json`` output); ``unit`` is
    appended to the rate (``12.3 shards/s``).
    """
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    console = console if console is not None else Console(file=sys.stderr)
    rate = TextColumn("{task.fields[rate]}")
    bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(),
                   rate, TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=console,
                   transient=transient, refresh_per_second=4)
    unit_text = f" {unit}/s" if unit else "/s"
    with bar:
        task_id = bar.add_task(description, total=total, rate="")
        yield ProgressTask(bar, task_id, unit_text)

