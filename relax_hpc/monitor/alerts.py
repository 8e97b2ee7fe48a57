"""Alerts: a dead role, a NaN loss, a stalled trainer.

:func:`detect` is pure: it reads a snapshot (:meth:`relax_hpc.monitor.state.RunMonitor.snapshot`) and says what is
wrong. :class:`AlertWatcher` is what the monitor (and the launcher's wait loop) calls on each refresh: every distinct
alert (kind + proc) fires once. Firing writes an ``alert`` record to the event log (always) and notifies the
Apprise URLs of ``monitor.alert_urls`` (when set). Alerts already in the run's event logs, written by another
monitor or an earlier incarnation of this one, count as fired, so restarting the monitor does not page twice.
Nothing fires for a run that has ended (``STATUS.json`` exists): its dead roles are history, not news.
"""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc.config.schema import MonitorConfig
from relax_hpc.events import EventLog
from relax_hpc.fsio import read_json
from relax_hpc.monitor.state import LIVE_STATES
from relax_hpc.rundir import RunDir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Alert:
    """One problem of one process."""

    event: str
    """``role_dead``, ``nan_loss`` or ``stall``."""
    target: str
    """The proc it is about (``rollout-3``, ``trainer-0``)."""
    message: str
    step: int | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.event, self.target)


def detect(snap: dict[str, Any], *, now: float | None = None) -> list[Alert]:
    """What is wrong in a run snapshot. Empty for a run that has ended."""
    if snap.get("ended"):
        return []
    now = time.time() if now is None else now
    step = snap.get("step")
    out = []
    for proc, r in sorted((snap.get("roles") or {}).items()):
        if r.get("state") == "dead":
            age = r.get("heartbeat_age_s")
            out.append(Alert("role_dead", proc, f"{proc} on {r.get('host') or '?'}: no heartbeat for "
                             f"{age if age is None else round(age)}s (last state {r.get('heartbeat_state')})", step))
    tproc = snap.get("trainer_proc")
    loss = snap.get("loss")
    if tproc and isinstance(loss, float) and not math.isfinite(loss):
        out.append(Alert("nan_loss", tproc, f"{tproc}: train/loss is {loss} at step {step}", step))
    stall_s = float((snap.get("monitor") or {}).get("stall_minutes", 15.0)) * 60
    since = snap.get("last_progress_time")
    if tproc and snap.get("trainer_state") in LIVE_STATES and isinstance(since, int | float) and now - since > stall_s:
        out.append(Alert("stall", tproc, f"{tproc}: no trainer progress for {(now - since) / 60:.1f} min "
                         f"(step {step}, limit {stall_s / 60:g} min)", step))
    return out


class AlertWatcher:
    """Fires each distinct alert of a run once: an event-log ``alert`` record plus Apprise notifications.

    ``monitor_cfg`` gives the Apprise URLs; by default it is read from the run's ``config.json`` (until found).
    ``event_log`` is where alert records go; by default a ``monitor-<pid>`` log, opened on the first alert only,
    so a monitor that has nothing to report writes nothing to the run dir.
    """

    def __init__(self, run_dir: RunDir | Path | str, monitor_cfg: MonitorConfig | None = None, *,
                 event_log: EventLog | None = None):
        self.rd = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.monitor_cfg = monitor_cfg
        self.event_log = event_log
        self._own_log = event_log is None
        self.fired: set[tuple[str, str]] = set()
        self.sent = 0
        """Notifications Apprise accepted."""

    def _cfg(self) -> MonitorConfig:
        if self.monitor_cfg is None:
            try:
                cfg = read_json(self.rd.config, default=None)
                if isinstance(cfg, dict):
                    self.monitor_cfg = MonitorConfig.model_validate(cfg.get("monitor") or {})
            except (OSError, ValueError) as exc:
                log.warning("cannot read monitor settings from %s: %s", self.rd.config, exc)
        return self.monitor_cfg or MonitorConfig.model_validate({})

    def check(self, snap: dict[str, Any], *, now: float | None = None) -> list[Alert]:
        """Fire the alerts of ``snap`` that have not fired yet (here or in the event logs); return them."""
        logged = {(str(a.get("event")), str(a.get("target"))) for a in snap.get("alerts") or []}
        fired = []
        for alert in detect(snap, now=now):
            if alert.key in self.fired or alert.key in logged:
                self.fired.add(alert.key)
                continue
            self.fired.add(alert.key)
            self._record(alert, snap)
            self._notify(alert, snap)
            fired.append(alert)
        return fired

    def _record(self, alert: Alert, snap: dict[str, Any]) -> None:
        try:
            if self.event_log is None:
                self.event_log = EventLog(self.rd, "monitor", os.getpid())
            self.event_log.alert(alert.event, alert.message, step=alert.step, target=alert.target,
                                 run_id=snap.get("run_id"))
        except OSError as exc:  # a read-only run dir (someone else's run): still notify
            log.warning("cannot write alert to the event log: %s", exc)

    def _notify(self, alert: Alert, snap: dict[str, Any]) -> None:
        urls = self._cfg().alert_urls
        if not urls:
            return
        with warnings.catch_warnings():  # apprise imports the deprecated imghdr module on first use
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                self._send(urls, alert, snap)
            except ImportError:
                log.warning("monitor.alert_urls is set but apprise is not installed (pip install apprise)")

    def _send(self, urls: list[str], alert: Alert, snap: dict[str, Any]) -> None:
        import apprise

        ap = apprise.Apprise()
        for url in urls:
            if not ap.add(url):
                log.warning("ignoring an alert URL apprise does not understand (scheme %s)", url.split(":", 1)[0])
        title = f"relax-hpc {snap.get('name') or snap.get('run_id') or self.rd.root.name}: {alert.event} {alert.target}"
        body = f"{alert.message}\nrun dir: {self.rd.root}"
        if ap.notify(title=title, body=body, notify_type=apprise.NotifyType.FAILURE):
            self.sent += 1
        else:
            log.warning("alert %s/%s: notification failed", alert.event, alert.target)

    def close(self) -> None:
        if self._own_log and self.event_log is not None:
            self.event_log.close()
            self.event_log = None
