"""Rich renderings of run and sweep snapshots (what ``relax-hpc monitor`` draws)."""

from __future__ import annotations

import math
import time
from typing import Any

from rich import box
from rich.columns import Columns
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from relax_hpc.roles.spec import role_names, trainer_side_names

STATE_STYLES = {"running": "green", "starting": "cyan", "draining": "cyan", "paused": "yellow", "stopped": "dim",
                "completed": "bold green", "waiting": "dim", "pending": "dim", "dead": "bold red", "failed": "red",
                "stale": "red", "unknown": "magenta", "interrupted": "yellow"}
PROBLEM_STATES = ("dead", "failed", "unknown", "waiting", "paused")
ROLE_ORDER = (*trainer_side_names(), *(n for n in role_names() if n not in trainer_side_names()))
"""Order of the role rows: the trainer-side roles first (from the role table)."""
METRIC_ROWS = (
    (("reward", "reward_mean"), ("loss", "loss"), ("KL", "kl"), ("entropy", "entropy"), ("clip frac", "clipfrac")),
    (("samples/s", "samples_per_s"), ("tokens/s", "tokens_per_s"), ("step time", "step_time"),
     ("resp len", "response_length")),
    (("staleness", "staleness"), ("backlog", "backlog"), ("mismatch KL", "mismatch_kl"),
     ("eval acc", "eval_accuracy"), ("eval @v", "eval_version")),
    (("resp p50", "response_p50"), ("resp p99", "response_p99"), ("resp max", "response_max"),
     ("decode occ", "decode_occupancy"), ("occ<25%", "decode_low_occupancy_time")),
)
"""Label and snapshot key of the headline numbers: learning, throughput, asynchrony and the train/rollout mismatch,
the newest held-out evaluation (accuracy and the weight version it evaluated)."""
AGENT_ROW = (("turns/ep", "turns"), ("calls/turn", "tool_calls"), ("tool errs", "tool_errors"),
             ("tool lat", "tool_latency"), ("truncated", "truncations"))
"""Multi-turn episodes (shown when the run reports them)."""
PARTIAL_ROW = (("carried tok", "carried_tokens"), ("carried age", "carried_age"), ("carried grp", "carried_groups"),
               ("aborted", "partial_aborted"), ("dropped", "partial_dropped"))
"""Partial rollouts in colocate (shown when the run reports them): tokens trained that an earlier step generated,
their mean age in versions, groups carried into the next step, samples aborted, carried groups dropped as too old."""
OPTIONAL_ROWS = (AGENT_ROW, PARTIAL_ROW)
"""Rows shown only when the run reports one of their metrics."""


def fmt_num(v: Any) -> str:
    """A metric for a narrow column: ``-`` when missing, ``nan`` kept visible, thousands separated."""
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    v = float(v)
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if v == int(v):
        return str(int(v))
    if a >= 100:
        return f"{v:.1f}"
    return f"{v:.4g}"


def fmt_duration(s: float | None) -> str:
    """``45s``, ``3m05s``, ``2h07m``, ``3d04h``; ``-`` when unknown."""
    if s is None or not math.isfinite(s):
        return "-"
    s = max(0, round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def state_text(state: str | None) -> Text:
    state = state or "-"
    return Text(state, style=STATE_STYLES.get(state, ""))


def trend_text(trend: float | None, *, arrow_only: bool = False) -> Text:
    """``↑ +0.0031/step`` (green), ``↓ ...`` (red) or ``→`` for the reward's recent slope."""
    if trend is None or not math.isfinite(trend):
        return Text("")
    arrow, style = ("↑", "green") if trend > 0 else ("↓", "red") if trend < 0 else ("→", "dim")
    return Text(f" {arrow}" if arrow_only else f" {arrow} {trend:+.3g}/step", style=style)


def _header(snap: dict[str, Any]) -> RenderableType:
    step, total = snap.get("step"), snap.get("total_steps")
    line = Text()
    line.append(f"step {step if step is not None else '-'}/{total or '-'}  ", style="bold")
    bar = ProgressBar(total=float(total or 1), completed=float(step or 0), width=30)
    eta = Text(f"  {snap['progress'] * 100:.0f}%" if snap.get("progress") is not None else "  -")
    eta.append(f"  ETA {fmt_duration(snap.get('eta_s'))}")
    eta.append(f"   weights v{snap.get('weight_version') if snap.get('weight_version') is not None else '-'}")
    since = snap.get("last_progress_time")
    if since is not None:
        eta.append(f"   last progress {fmt_duration(snap['time'] - since)} ago", style="dim")
    top = Table.grid(padding=0)
    top.add_row(line, bar, eta)
    shown = [row for row in OPTIONAL_ROWS if any(snap.get(key) is not None for _, key in row)]
    lines: list[RenderableType] = []
    for group in (*METRIC_ROWS, *shown):
        cells: list[RenderableType] = []
        for label, key in group:  # "label value" cells that flow onto more lines when narrow, never cut
            v = snap.get(key)
            cell = Text(label, style="dim", no_wrap=True)
            cell.append(" ")
            cell.append(fmt_num(v), style="bold red" if key == "loss" and _nonfinite(v) else "bold")
            if key == "reward_mean":
                cell.append_text(trend_text(snap.get("reward_trend")))
            cells.append(cell)
        lines.append(Columns(cells, padding=(0, 3)))
    metrics = Group(*lines)
    title = Text.assemble(("relax-hpc ", "bold"), (str(snap.get("name") or "run"), "bold cyan"), "  ",
                          (str(snap.get("run_id") or ""), "dim"), "  ", (str(snap.get("mode") or ""), ""), "  ",
                          state_text(snap.get("state")))
    return Panel(Group(top, metrics), title=title, title_align="left", subtitle=str(snap.get("run_dir", "")),
                 subtitle_align="right")


def _nonfinite(v: Any) -> bool:
    return isinstance(v, float) and not math.isfinite(v)


def _role_key(item: tuple[str, dict[str, Any]]) -> tuple[int, int, str, int]:
    proc, r = item
    state = r.get("state")
    problem = PROBLEM_STATES.index(state) if state in PROBLEM_STATES else len(PROBLEM_STATES)
    role = str(r.get("role") or proc)
    order = ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER)
    rank = r.get("rank")
    return (problem, order, role, rank if isinstance(rank, int) else 0)


def roles_table(roles: dict[str, dict[str, Any]], *, max_rows: int = 40) -> Text:
    """One row per process, problems first; beyond ``max_rows`` a summary row counts the rest by state.

    Drawn as pre-padded text rather than a rich ``Table``: with 64 roles that is ~10x cheaper to render, which is
    most of the live view's idle CPU.
    """
    slurm = any(r.get("slurm_job_id") for r in roles.values())
    header = ["proc", "host", "state", "heartbeat", "step", "weights", "pid"] + (["slurm job", "slurm"] if slurm
                                                                                 else [])
    right = {3, 4, 5, 6}
    items = sorted(roles.items(), key=_role_key)
    shown, rest = items[:max_rows], items[max_rows:]
    rows: list[tuple[list[str], str]] = []
    for proc, r in shown:
        age = r.get("heartbeat_age_s")
        state = str(r.get("state") or "-")
        cells = [proc, str(r.get("host") or "-"), state, fmt_duration(age) if age is not None else "-",
                 fmt_num(r.get("step")), f"v{r['version']}" if r.get("version") is not None else "-",
                 str(r.get("pid") or "-")]
        if slurm:
            cells += [str(r.get("slurm_job_id") or "-"), str(r.get("slurm_state") or "-")]
        rows.append((cells, state))
    widths = [max([len(header[c])] + [len(cells[c]) for cells, _ in rows]) for c in range(len(header))]

    def line(cells: list[str]) -> list[str]:
        return [cell.rjust(w) if c in right else cell.ljust(w) for c, (cell, w) in enumerate(zip(cells, widths,
                                                                                                 strict=True))]

    out = Text()
    out.append("roles\n", style="italic")
    out.append("  ".join(line(header)).rstrip() + "\n", style="bold")
    for cells, state in rows:
        padded = line(cells)
        out.append("  ".join(padded[:2]) + "  ")
        out.append(padded[2], style=STATE_STYLES.get(state, ""))
        out.append(("  " + "  ".join(padded[3:])).rstrip() + "\n")
    if rest:
        counts: dict[str, int] = {}
        for _, r in rest:
            counts[str(r.get("state"))] = counts.get(str(r.get("state")), 0) + 1
        summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        out.append(f"… {len(rest)} more: {summary}\n", style="dim")
    out.rstrip()
    out.no_wrap = True
    out.overflow = "ellipsis"
    return out


def recent_table(recent: list[dict[str, Any]], *, max_rows: int = 8) -> Table:
    """The newest warnings, errors and alerts."""
    t = Table(title="recent warnings and errors", title_justify="left", box=None, pad_edge=False,
              header_style="bold")
    for col in ("time", "proc", "level", "event", "message"):
        t.add_column(col, overflow="ellipsis", no_wrap=col != "message")
    for r in recent[-max_rows:]:
        when = time.strftime("%H:%M:%S", time.localtime(r["time"])) if r.get("time") else "-"
        level = "alert" if r.get("kind") == "alert" else str(r.get("level") or "-")
        style = "bold red" if level in ("alert", "error") else "yellow"
        t.add_row(when, str(r.get("proc") or "-"), Text(level, style=style), str(r.get("event") or "-"),
                  str(r.get("message") or ""))
    if not recent:
        t.add_row("-", "", Text("none", style="dim"), "", "")
    return t


def run_view(snap: dict[str, Any], *, max_role_rows: int = 40) -> RenderableType:
    """The whole screen for one run."""
    return Group(_header(snap), roles_table(snap.get("roles") or {}, max_rows=max_role_rows), Text(""),
                 recent_table(snap.get("recent") or []))


def _params_text(params: Any) -> str:
    if isinstance(params, dict):
        return " ".join(f"{k}={v}" for k, v in params.items())
    if isinstance(params, list):
        return " ".join(str(p) for p in params)
    return "" if params is None else str(params)


def sweep_view(sweep: dict[str, Any]) -> RenderableType:
    """One row per run of a sweep (its overrides, if known, on a dim line under its name)."""
    runs = sweep.get("runs") or []
    show_alerts = any(snap.get("alerts") for snap in runs)
    t = Table(title=f"sweep {sweep.get('sweep', '')}", title_justify="left", header_style="bold",
              box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("run", overflow="fold")
    for col in ("state", "step", "ETA", "reward", "loss", "smp/s", "stale", "roles") + (("alerts",) if show_alerts
                                                                                        else ()):
        t.add_column(col, justify="left" if col == "state" else "right", no_wrap=True)
    for snap in runs:
        roles = snap.get("roles") or {}
        alive = sum(1 for r in roles.values() if r.get("state") in ("running", "starting", "paused", "draining"))
        dead = sum(1 for r in roles.values() if r.get("state") in ("dead", "failed"))
        role_text = Text(f"{alive}/{len(roles)}")
        if dead:
            role_text.append(f" {dead}✗", style="bold red")
        reward = Text(fmt_num(snap.get("reward_mean")))
        reward.append_text(trend_text(snap.get("reward_trend"), arrow_only=True))
        name = Text(str(snap.get("label") or snap.get("name") or "-"))
        params = _params_text(snap.get("params"))
        if params:
            name.append("\n" + params, style="dim")
        step = "-" if snap.get("step") is None else snap["step"]
        cells: list[RenderableType] = [
            name, state_text(snap.get("state")), f"{step}/{snap.get('total_steps') or '-'}",
            fmt_duration(snap.get("eta_s")), reward, fmt_num(snap.get("loss")), fmt_num(snap.get("samples_per_s")),
            fmt_num(snap.get("staleness")), role_text]
        if show_alerts:
            cells.append(Text(str(len(snap.get("alerts") or [])), style="bold red" if snap.get("alerts") else ""))
        t.add_row(*cells)
    return t
