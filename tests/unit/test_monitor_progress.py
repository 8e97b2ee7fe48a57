"""The ``progress`` helper others use for long local work."""

from __future__ import annotations

import io

from rich.console import Console

from relax_hpc.monitor.progress import progress


def test_progress_counts_and_prints_final_state() -> None:
    buf = io.StringIO()
    with progress(10, "exporting", console=Console(file=buf, width=120), unit="shards") as bar:
        for _ in range(7):
            bar.advance()
        bar.update(completed=10, description="exported")
        assert bar.completed == 10 and bar.total == 10
    out = buf.getvalue()
    assert "exported" in out and "10/10" in out and "shards/s" in out


def test_progress_unknown_total_and_terminal() -> None:
    buf = io.StringIO()
    with progress(None, "scanning", console=Console(file=buf, width=120, force_terminal=True),
                  transient=True) as bar:
        bar.advance(5)
        bar.update(total=5)
        assert bar.total == 5 and bar.completed == 5
    assert "scanning" in buf.getvalue()
