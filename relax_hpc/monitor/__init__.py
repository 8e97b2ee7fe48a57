"""Watching runs: everything here reads the run dir only (plus one rate-limited ``squeue``), so it works from a login
node while the job runs, after it ended, and for a whole sweep.

* :mod:`~relax_hpc.monitor.tail` -- incremental JSON-lines readers (half-written lines, files appearing later).
* :mod:`~relax_hpc.monitor.state` -- :class:`RunMonitor`: event logs + heartbeats + config -> a JSON-ready snapshot.
* :mod:`~relax_hpc.monitor.sweep` -- :class:`SweepMonitor`: one row per run of a sweep folder.
* :mod:`~relax_hpc.monitor.alerts` -- :class:`AlertWatcher`: dead role, NaN loss, stall -> event log + Apprise.
* :mod:`~relax_hpc.monitor.sinks` -- :func:`make_sinks`: TensorBoard / W&B beside the JSON lines.
* :mod:`~relax_hpc.monitor.plot` -- training curves to a PNG.
* :mod:`~relax_hpc.monitor.progress` -- :func:`progress`, a rich progress bar for long local work.
* :mod:`~relax_hpc.monitor.view`, :mod:`~relax_hpc.monitor.live` -- the terminal view and its loop.

Names are imported lazily (``from relax_hpc.monitor import make_sinks`` loads only the sinks module), so the trainer
does not pay for rich or matplotlib.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"RunMonitor": "state", "SweepMonitor": "sweep", "AlertWatcher": "alerts", "make_sinks": "sinks",
            "MetricsSink": "sinks", "progress": "progress", "load_history": "plot", "plot_histories": "plot"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
