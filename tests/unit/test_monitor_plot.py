"""``relax-hpc plot``: a non-empty PNG with the expected lines, for a run and for a sweep."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from relax_hpc.bench.monitor import SyntheticRun
from relax_hpc.cli import main
from relax_hpc.events import EventLog
from relax_hpc.fsio import atomic_write_json
from relax_hpc.monitor.plot import PANELS, load_history, plot_histories, smooth_curve
from relax_hpc.rundir import RunDir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def labelled_lines(ax: object) -> list[str]:
    return [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")]  # type: ignore[attr-defined]


def synthetic(root: Path, name: str, lines: int, seed: int = 0) -> RunDir:
    run = SyntheticRun(root, num_roles=3, name=name, seed=seed)
    run.append(lines)
    run.close()
    return run.rd


def test_plot_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rd = synthetic(tmp_path / "run", "solo", 120)  # 60 trainer steps
    out = tmp_path / "curves.png"
    assert main(["plot", str(rd.root), "-o", str(out)]) == 0
    assert "1 run, up to 60 steps" in capsys.readouterr().out
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000

    hist = load_history(rd)
    assert hist.label == "solo" and hist.num_steps == 60
    fig = plot_histories([hist])
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == [p[0] for p in PANELS]
    absent = {"held-out eval (weight version)", "train/rollout mismatch KL"}  # the synthetic run has neither
    for ax, (title, curves) in zip(axes, PANELS, strict=True):
        if title in absent:
            assert not ax.get_lines() and [t.get_text() for t in ax.texts] == ["no data"]
            continue
        assert len(labelled_lines(ax)) == len(curves)  # one line per metric
        assert len(ax.get_lines()) == 2 * len(curves)  # smoothed (60 points) over a faint raw line
    assert labelled_lines(axes[[p[0] for p in PANELS].index("trainer idle fraction (fully_async)")]) == ["trainer"]
    steps, values = hist.curve("rollout/reward")
    assert steps == list(range(1, 61)) and axes[0].get_lines()[0].get_ydata().tolist() == values


def test_plot_sweep_one_line_per_run(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for i in range(3):
        synthetic(sweep / f"run{i}", f"run{i}", 20 + 20 * i, seed=i)
    (sweep / "notes").mkdir()  # not a run: ignored
    atomic_write_json(sweep / "sweep.json", [{"run_dir": "run9", "name": "pending"}])  # listed, not started
    out = tmp_path / "sweep.png"
    assert main(["plot", str(sweep), "-o", str(out), "--no-smooth", "--title", "lr sweep"]) == 0
    assert out.read_bytes().startswith(PNG_MAGIC)
    from relax_hpc.monitor.sweep import find_runs

    hists = [load_history(e.path, label=e.label) for e in find_runs(sweep) if RunDir(e.path).is_run_dir()]
    fig = plot_histories(hists, title="lr sweep", smooth=False)
    for ax, (title, curves) in zip(fig.axes, PANELS, strict=True):
        if not title.startswith(("held-out", "train/rollout")):  # the synthetic runs have no eval, no mismatch
            assert len(ax.get_lines()) == 3 * len(curves)
    assert labelled_lines(fig.axes[0]) == ["run0", "run1", "run2"]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["run0", "run1", "run2"]
    assert fig._suptitle.get_text() == "lr sweep"


def test_nan_and_missing_metrics(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / "run")
    with EventLog(rd, "colocate", 0) as log:
        for step in range(1, 6):
            log.metrics({"train/loss": float("nan") if step == 4 else 1.0 / step}, step=step)
        log.metrics({"train/loss": 0.1}, step=5)  # a resumed run re-logs step 5: the last value wins
    hist = load_history(rd)
    steps, values = hist.curve("train/loss")
    assert steps == [1, 2, 3, 4, 5] and math.isnan(values[3]) and values[4] == 0.1
    fig = plot_histories([hist], tmp_path / "x.png")
    assert fig.axes[1].get_title() == "loss  (1 non-finite)"
    assert len(fig.axes[0].get_lines()) == 0 and fig.axes[0].texts[0].get_text() == "no data"
    assert (tmp_path / "x.png").stat().st_size > 10_000


def test_smooth_curve() -> None:
    assert smooth_curve([2.0] * 9, 5) == [2.0] * 9  # exactly constant, no round-off
    got = smooth_curve([0.0, 3.0, float("nan"), 3.0, 0.0], 3)
    assert got == [1.5, 1.5, 3.0, 1.5, 1.5]
    assert math.isnan(smooth_curve([float("nan")] * 3, 3)[1])


def test_plot_refuses_a_missing_output_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rd = synthetic(tmp_path / "run", "solo", 10)
    assert main(["plot", str(rd.root), "-o", str(tmp_path / "nope" / "c.png")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot write")
    assert json.loads(rd.config.read_text())["name"] == "solo"
