"""Training curves of a run or a sweep as one PNG: reward, loss, throughput, staleness, trainer idle fraction, the
held-out evaluation and the train/rollout mismatch over steps.

The trainer's metric records (``trainer-0`` or ``colocate-0``) are read in full; a step logged twice (a resumed run
re-doing steps after its checkpoint) keeps its last value. Long curves are drawn faint with a centred moving
average on top; non-finite values (a NaN loss) leave a gap and are counted in the panel title. Matplotlib is used
without pyplot (no global state, no display needed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_hpc.fsio import read_json
from relax_hpc.monitor.state import TRAINER_PROCS, as_float
from relax_hpc.monitor.tail import JsonlTail
from relax_hpc.rundir import RunDir

PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("reward (mean)", (("rollout/reward", ""),)),
    ("loss", (("train/loss", ""),)),
    ("samples / s", (("perf/samples_per_s", ""),)),
    ("tokens / s", (("perf/tokens_per_s", ""),)),
    ("staleness (policy versions)", (("rollout/staleness_mean", ""),)),
    ("trainer idle fraction (fully_async)", (("perf/train_idle_fraction", "trainer"),)),
    ("held-out eval (weight version)", (("eval/accuracy", "mean reward"), ("eval/accuracy_thresholded", "correct"))),
    ("train/rollout mismatch KL", (("train/mismatch_kl", ""),)),
)
"""Panel title -> (metric name, series label) of each curve in it: metrics the trainer's log holds (a rollout
worker's pauses are in its own log, ``perf/rollout_pause_time``, shown by ``relax-hpc monitor``)."""
LINESTYLES: tuple[Any, ...] = ("-", "--", ":", "-.")
SMOOTH_MIN_POINTS = 20
"""Curves with at least this many points get a moving-average line over a faint raw line."""


@dataclass
class History:
    """All trainer metrics of one run: metric name -> step -> value."""

    label: str
    series: dict[str, dict[int, float]] = field(default_factory=dict)

    def curve(self, name: str) -> tuple[list[int], list[float]]:
        points = sorted(self.series.get(name, {}).items())
        return [s for s, _ in points], [v for _, v in points]

    @property
    def num_steps(self) -> int:
        return max((len(v) for v in self.series.values()), default=0)


def load_history(run_dir: RunDir | Path | str, label: str | None = None) -> History:
    """Read the trainer's metric records of a run (the first of ``trainer-0``, ``colocate-0`` that has a log).

    ``label`` defaults to the run's name in ``config.json``, else the folder name.
    """
    rd = run_dir if isinstance(run_dir, RunDir) else RunDir.open(run_dir)
    if label is None:
        try:
            cfg = read_json(rd.config, default={})
        except (OSError, ValueError):
            cfg = {}
        label = str(cfg.get("name") or rd.root.name) if isinstance(cfg, dict) else rd.root.name
    hist = History(label=label)
    path = next((rd.event_log(p) for p in TRAINER_PROCS if rd.event_log(p).is_file()), None)
    if path is None:
        _add_evals(rd, hist)
        return hist
    for rec in JsonlTail(path).read():
        step, metrics = rec.get("step"), rec.get("metrics")
        if rec.get("kind") != "metrics" or not isinstance(step, int) or not isinstance(metrics, dict):
            continue
        for name, value in metrics.items():
            v = as_float(value)
            if v is not None:
                hist.series.setdefault(name, {})[step] = v
    _add_evals(rd, hist)
    return hist


def _add_evals(rd: RunDir, hist: History) -> None:
    """The run's held-out evaluations (``eval/vNNNNNN.json``, whichever process wrote them), at their version."""
    from relax_hpc.eval.evaluator import read_results

    for version, metrics in read_results(rd).items():
        for name, value in metrics.items():
            hist.series.setdefault(name, {})[version] = value


def smooth_curve(values: list[float], window: int | None = None) -> list[float]:
    """Centred moving average (no lag, unlike an EMA), skipping non-finite values; the window shrinks at the ends.

    ``window`` defaults to about 1/25 of the curve (at least 5 points).
    """
    import numpy as np

    a = np.asarray(values, dtype=float)
    n = len(a)
    window = window or max(5, n // 25)
    finite = np.isfinite(a)
    csum = np.concatenate([[0.0], np.cumsum(np.where(finite, a, 0.0))])
    ccount = np.concatenate([[0], np.cumsum(finite)])
    idx = np.arange(n)
    lo, hi = np.clip(idx - window // 2, 0, n), np.clip(idx + window // 2 + 1, 0, n)
    count = ccount[hi] - ccount[lo]
    out = (csum[hi] - csum[lo]) / np.maximum(count, 1)
    out[count == 0] = np.nan
    if finite.any():  # no round-off wiggles: a constant curve stays exactly constant
        out = np.clip(out, a[finite].min(), a[finite].max())
    return out.tolist()


def plot_histories(histories: list[History], out: Path | str | None = None, *, title: str | None = None,
                   smooth: bool = True) -> Any:
    """Draw the panels for one or more runs (one colour per run) and save a PNG to ``out`` if given.

    Returns the matplotlib ``Figure``. Each curve has exactly one labelled line (``run`` or ``run series``); its
    faint raw companion, when smoothed, is labelled ``_raw`` (matplotlib hides labels that start with ``_``).
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    sweep = len(histories) > 1
    rows = -(-len(PANELS) // 3)
    fig = Figure(figsize=(15, 4.25 * rows), layout="constrained")
    grid = fig.subplots(rows, 3, sharex=True).ravel()
    for spare in grid[len(PANELS):]:
        spare.remove()
    axes = grid[:len(PANELS)]
    colors = [f"C{i % 10}" for i in range(len(histories))]
    raw_alpha = 0.12 if sweep else 0.3  # many faint raw curves would hide the smoothed ones
    for ax, (panel, curves) in zip(axes, PANELS, strict=True):
        drawn, nonfinite, top = 0, 0, 0.0
        for color, hist in zip(colors, histories, strict=True):
            for (name, series), style in zip(curves, LINESTYLES, strict=False):
                steps, values = hist.curve(name)
                if not steps:
                    continue
                nonfinite += sum(1 for v in values if not math.isfinite(v))
                top = max([top] + [v for v in values if math.isfinite(v)])
                label = " ".join(x for x in (hist.label if sweep else "", series) if x) or hist.label
                if smooth and len(steps) >= SMOOTH_MIN_POINTS:
                    ax.plot(steps, values, color=color, linestyle=style, linewidth=0.8, alpha=raw_alpha,
                            label="_raw")
                    ax.plot(steps, smooth_curve(values), color=color, linestyle=style, linewidth=1.8, label=label)
                else:
                    ax.plot(steps, values, color=color, linestyle=style, linewidth=1.5, label=label,
                            marker="o" if len(steps) <= 30 else None, markersize=3)
                drawn += 1
        ax.set_title(panel + (f"  ({nonfinite} non-finite)" if nonfinite else ""),
                     color="red" if nonfinite else "black", fontsize=11)
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False)
        if not drawn:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
        if "idle fraction" in panel:
            ax.set_ylim(0, min(1.02, max(0.1, top * 1.2)))  # a fraction: from 0, but not squashed flat
        if len(curves) > 1 and drawn:  # several series in one panel: a legend of their line styles
            ax.legend(handles=[Line2D([], [], color="black" if sweep else colors[0], linestyle=st, label=s)
                               for (_, s), st in zip(curves, LINESTYLES, strict=False)],
                      loc="upper right", fontsize=9)
    for ax in axes[-3:]:
        ax.set_xlabel("step")
    if sweep:
        handles = [Line2D([], [], color=c, linewidth=2, label=h.label) for c, h in zip(colors, histories, strict=True)]
        fig.legend(handles=handles, loc="outside right upper", fontsize=9, title="run")
    fig.suptitle(title or (f"{len(histories)} runs" if sweep else histories[0].label if histories else ""),
                 fontsize=13, fontweight="bold")
    if out is not None:
        fig.savefig(out, dpi=110)
    return fig
