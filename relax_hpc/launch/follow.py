"""Follow a run from the launcher: a progress bar fed by the trainer's metric lines in the run dir."""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.lifecycle import EXIT_REQUEUE
from relax_hpc.roles.spec import main_proc
from relax_hpc.rundir import RunDir


class ProgressFeed:
    """Tails the trainer's event log; renders step / total, reward and step time."""

    def __init__(self, run_dir: RunDir, cfg: RecipeConfig, *, since: float | None = None):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from relax_hpc.monitor.tail import DirTail

        self.cfg = cfg
        self.main_proc = main_proc(cfg)  # the process logging the step metrics
        self.tail = DirTail(run_dir.events)
        self.console = Console(stderr=True)
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.console,
                                 transient=False)
        self.task = self.progress.add_task(cfg.name, total=cfg.num_steps, info="starting ...")
        self.since = since  # records older than this (a resumed run's earlier incarnations) are not shown
        self.errors: list[str] = []  # the roles' "failed" events (a user error: one line each)
        self.first_reward: float | None = None
        self.last: dict[str, Any] = {}
        self.run_dir = run_dir
        self._alerts: Any = None
        self._next_alert_check = time.monotonic() + 10.0
        self.progress.start()

    def tick(self) -> None:
        for proc, rec in self.tail.read():
            if self.since is not None and float(rec.get("time") or 0.0) < self.since:
                continue
            if rec.get("kind") == "event" and rec.get("event") == "failed" and rec.get("level") == "error":
                self.errors.append(f"{proc}: {rec.get('message')}")
            elif rec.get("kind") == "metrics" and proc == self.main_proc and rec.get("step") is not None:
                m = rec.get("metrics", {})
                if "warmup/loss" in m:
                    self.console.print(f"supervised warm-up done: loss {m['warmup/loss']:.3f}")
                    continue
                r = m.get("rollout/reward")
                if isinstance(r, (int, float)):
                    if self.first_reward is None:
                        self.first_reward = r
                    self.last = m
                info = f"reward {r:.3f}" if isinstance(r, (int, float)) else ""
                st = m.get("perf/step_time")
                if isinstance(st, (int, float)):
                    info += f"  {st:.2f}s/step"
                self.progress.update(self.task, completed=int(rec["step"]), info=info)
            elif rec.get("kind") in ("event", "alert") and rec.get("level") in ("warning", "error"):
                self.console.print(f"{proc}: {rec.get('event')}: {rec.get('message')}", style="yellow", markup=False)

        if time.monotonic() >= self._next_alert_check:
            self._next_alert_check = time.monotonic() + 10.0
            self.check_alerts()

    def check_alerts(self) -> None:
        """Dead roles, NaN losses and stalls: notify (Apprise URLs of the recipe) and write them to the event log."""
        from relax_hpc.monitor.alerts import AlertWatcher
        from relax_hpc.monitor.state import RunMonitor

        try:
            if self._alerts is None:
                self._alerts = (AlertWatcher(self.run_dir, self.cfg.monitor), RunMonitor(self.run_dir))
            watcher, monitor = self._alerts
            for alert in watcher.check(monitor.refresh()):
                self.console.print(f"alert: {alert}", style="red", markup=False)
        except Exception as exc:  # alerting must never stop the launcher
            self.console.print(f"alert check failed: {exc}", style="yellow", markup=False)

    def close(self) -> None:
        self.tick()
        self.progress.stop()


INTERRUPTED_CODES = (EXIT_REQUEUE, 130, 128 + signal.SIGTERM)
"""Exit codes of a local run stopped by Ctrl-C, SIGTERM or ``relax-hpc cancel`` (the roles checkpointed)."""


def run_state(code: int) -> str:
    """``completed``, ``interrupted`` (Ctrl-C / SIGTERM / cancel: resumable) or ``failed``, from the exit code."""
    return "completed" if code == 0 else "interrupted" if code in INTERRUPTED_CODES else "failed"


def follow_local(run_dir: RunDir, cfg: RecipeConfig, procs: list[Any], *, since: float | None = None) -> int:
    """Supervise a local run until it ends; write ``STATUS.json`` and print how it ended. ``since``: show only
    records written from then on (a resumed run)."""
    from relax_hpc.launch.local import Interrupts, supervise

    feed = ProgressFeed(run_dir, cfg, since=since)
    t0 = time.time()
    interrupts = Interrupts().install()  # SIGTERM stops the run as Ctrl-C does (the roles checkpoint)
    try:
        try:
            code = supervise(run_dir, cfg, procs, on_tick=feed.tick, interrupts=interrupts)
        finally:
            interrupts.settle()  # the roles have exited: a signal now must not cut the recording of the end
            feed.close()
        return _record_end(run_dir, feed, code, t0, forced=interrupts.forced)
    finally:
        interrupts.restore()


def _record_end(run_dir: RunDir, feed: ProgressFeed, code: int, t0: float, *, forced: bool = False) -> int:
    """``STATUS.json`` and the lines saying how a local run ended; returns ``code``. ``forced``: the roles were
    stopped before they finished checkpointing."""
    from relax_hpc.fsio import atomic_write_json

    state = run_state(code)
    if not run_dir.status_file.exists() or state != "completed":
        atomic_write_json(run_dir.status_file, {"state": state, "exit_code": code, "time": time.time()})
    r0, r1 = feed.first_reward, feed.last.get("rollout/reward")
    if code == 0:
        msg = f"run {state} in {time.time() - t0:.0f}s"
        if r0 is not None and r1 is not None:
            msg += f": mean reward {r0:.3f} (first step) -> {r1:.3f} (last step)"
        print(msg)
    elif state == "interrupted":
        how = "the roles were stopped before their checkpoint was done; `relax-hpc resume` continues from the last " \
              "complete one" if forced else "the roles checkpointed"
        print(f"run interrupted (exit code {code}): {how}; continue with `relax-hpc resume {run_dir.root}`",
              file=sys.stderr)
    else:
        for line in dict.fromkeys(feed.errors):  # a user error of a role: its one line
            print(f"error: {line}", file=sys.stderr)
        print(f"run {state} (exit code {code}); logs: {run_dir.logs}", file=sys.stderr)
    print(f"run dir: {run_dir.root}")
    return code


def follow_slurm(run_dir: RunDir, cfg: RecipeConfig, *, poll_s: float = 2.0) -> int:
    """Follow a Slurm run until its jobs leave the queue; exit 0 if the trainer finished."""
    from relax_hpc.launch.slurm import run_finished

    feed = ProgressFeed(run_dir, cfg)
    # bounded by what Slurm itself allows the run: its time limit for every allowed requeue, plus queueing slack
    deadline = time.monotonic() + 60 * cfg.launch.time_min * (cfg.launch.max_requeues + 1) + 24 * 3600
    done: bool | None = None
    try:
        while time.monotonic() < deadline:
            feed.tick()
            done = run_finished(run_dir)
            if done is not None:
                break
            time.sleep(poll_s)
        else:
            print(f"stopped following after the run's whole time budget; it may still be queued: {run_dir.root}",
                  file=sys.stderr)
    finally:
        feed.close()
    from relax_hpc.fsio import read_json

    final = read_json(run_dir.status_file, default=None)
    cancelled = isinstance(final, dict) and final.get("state") == "interrupted"
    print(f"run {'completed' if done else 'interrupted' if cancelled else 'failed'}; run dir: {run_dir.root}")
    return 0 if done else 1
