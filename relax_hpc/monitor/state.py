"""The state of one run, rebuilt from its run dir: event/metric tails, heartbeats, config, launch record, STATUS.

:class:`RunMonitor` reads only what changed since the previous refresh (new bytes of the ``logs/events/*.jsonl``
files, heartbeats whose mtime changed), so a refresh of a big run costs a few milliseconds after the first read.
:meth:`RunMonitor.refresh` returns a *snapshot*: a JSON-ready dict documented in ``docs/monitor.md``. The
monitor writes nothing to the run dir (alerts are :mod:`relax_hpc.monitor.alerts`' business).
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_hpc.config.schema import MonitorConfig
from relax_hpc.fsio import read_json
from relax_hpc.monitor.slurm import SlurmPoller
from relax_hpc.monitor.tail import METRICS_MARK, DirTail
from relax_hpc.roles.spec import trainer_side_names
from relax_hpc.rundir import RunDir, proc_name

TRAINER_PROCS = tuple(proc_name(name, 0) for name in trainer_side_names())
"""Procs whose metrics are the run's headline numbers, in order of preference."""
LIVE_STATES = frozenset({"starting", "running", "paused", "draining"})
"""Heartbeat states of a process that is (supposed to be) alive."""
METRICS: dict[str, str] = {
    "reward_mean": "rollout/reward",
    "loss": "train/loss",
    "kl": "train/kl_loss",
    "entropy": "train/entropy_loss",
    "clipfrac": "train/pg_clipfrac",
    "response_length": "rollout/response_length",
    "samples_per_s": "perf/samples_per_s",
    "tokens_per_s": "perf/tokens_per_s",
    "staleness": "rollout/staleness_mean",
    "backlog": "store/backlog_samples",
    "step_time": "perf/step_time",
    "turns": "agent/turns_per_episode",
    "tool_calls": "agent/tool_calls_per_turn",
    "tool_errors": "agent/tool_errors",
    "tool_latency": "agent/tool_latency_s",
    "truncations": "agent/truncated_episodes",
    "episode_reward": "agent/episode_reward",
    "response_p50": "rollout/response_length_p50",
    "response_p99": "rollout/response_length_p99",
    "response_max": "rollout/response_length_max",
    "mismatch_kl": "train/mismatch_kl",
    "carried_tokens": "rollout/carried_tokens",
    "carried_age": "rollout/carried_age_mean",
    "carried_groups": "rollout/partial_carried_groups",
    "partial_aborted": "rollout/partial_aborted_samples",
    "partial_dropped": "rollout/partial_dropped_groups",
}
"""Snapshot key -> trainer metric name (``agent/*``: multi-turn episodes, relax_hpc/envs/metrics.py; ``carried_*``,
``partial_*``: partial rollouts in colocate, relax_hpc/rollout/partial.py)."""
DECODE_METRICS: dict[str, str] = {
    "decode_occupancy": "perf/decode_occupancy",
    "decode_low_occupancy_time": "perf/decode_low_occupancy_time",
    "decode_time": "perf/decode_time",
}
"""Snapshot key -> decode metric of an in-process engine: the trainer's (colocate) or, when it has none, the mean
over the rollout workers' latest values (fully_async)."""
RECENT_KEEP = 100
"""Warnings, errors and alerts kept for the snapshot's ``recent`` list."""


def as_float(value: Any) -> float | None:
    """A metric value as a float: numbers, and the strings ``nan``/``inf``/``-inf`` events.py writes; else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "-inf", "+inf", "infinity", "-infinity"):
        return float(value)
    return None


def json_safe(value: Any) -> Any:
    """Non-finite floats as strings (``"nan"``), recursively, as events.py writes them."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def slope(points: list[tuple[int, float]]) -> float | None:
    """Least-squares slope (value per step) of finite ``(step, value)`` points; None with fewer than 3."""
    pts = [(float(s), v) for s, v in points if math.isfinite(v)]
    if len(pts) < 3:
        return None
    n = len(pts)
    mx = sum(p[0] for p in pts) / n
    my = sum(p[1] for p in pts) / n
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


@dataclass
class _Trainer:
    """What the monitor tracks of one trainer proc."""

    metrics: dict[str, Any] = field(default_factory=dict)
    """Latest value of every metric key it logged."""
    step: int | None = None
    progress_time: float | None = None
    """Time of the record that first showed ``step``."""
    step_times: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=50))
    rewards: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=50))

    def note_step(self, step: int, t: float | None) -> None:
        if step == self.step:
            return
        self.step = step
        self.progress_time = t
        if t is not None:
            if self.step_times and step < self.step_times[-1][0]:
                self.step_times.clear()  # restarted from an earlier checkpoint
            self.step_times.append((step, t))


def last_progress(step_time: float | None, started: Any) -> float | None:
    """When the trainer last made progress: the record that first showed its step, or the start of the trainer
    process now running where that is later (a resumed run's trainer has shown no step of its own yet; the step
    record it resumed from may be hours old, and is no stall)."""
    start = float(started) if isinstance(started, int | float) else None
    if step_time is None or start is None:
        return step_time if start is None else start
    return max(step_time, start)


class RunMonitor:
    """Incrementally follows one run dir. Raises :class:`relax_hpc.errors.RunDirError` if it is not one."""

    def __init__(self, run_dir: RunDir | Path | str, *, slurm: SlurmPoller | None = None):
        self.rd = RunDir.open(run_dir.root if isinstance(run_dir, RunDir) else run_dir)
        self.info: dict[str, Any] = self.rd.info()
        self.slurm = slurm if slurm is not None else SlurmPoller()
        self.config: dict[str, Any] | None = None
        self.monitor_cfg = MonitorConfig.model_validate({})
        # Only the trainer's metrics are used: other procs' metrics lines are counted, not parsed.
        self._events = DirTail(self.rd.events, skip=lambda proc: None if proc in TRAINER_PROCS else METRICS_MARK,
                               keep=DECODE_METRICS["decode_occupancy"])
        self._decode: dict[str, dict[str, float]] = {}
        """Latest decode metrics of each rollout worker."""
        self._hb: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}
        self._launch: tuple[int, dict[str, Any]] | None = None
        self._trainers: dict[str, _Trainer] = {}
        self._recent: list[dict[str, Any]] = []
        self._alerts: dict[tuple[str, str], dict[str, Any]] = {}

    # ------------------------------------------------------------------------------------------------ reading
    def update(self) -> None:
        """Read what changed in the run dir since the last call."""
        if self.config is None:
            self._load_config()
        for stem, rec in self._events.read():
            self._ingest(stem, rec)
        self._read_heartbeats()
        self._read_launch()

    def _load_config(self) -> None:
        try:
            cfg = read_json(self.rd.config, default=None)
        except (OSError, ValueError):
            cfg = None
        if not isinstance(cfg, dict):
            return
        self.config = cfg
        try:
            self.monitor_cfg = MonitorConfig.model_validate(cfg.get("monitor") or {})
        except ValueError:
            self.monitor_cfg = MonitorConfig.model_validate({})

    def _ingest(self, stem: str, rec: dict[str, Any]) -> None:
        kind = rec.get("kind")
        proc = rec.get("proc") or stem
        t = rec.get("time") if isinstance(rec.get("time"), int | float) else None
        if kind == "metrics":
            metrics = rec.get("metrics")
            if not isinstance(metrics, dict):
                return
            if proc not in TRAINER_PROCS:
                self._note_decode(proc, metrics)
                return
            tr = self._trainers.setdefault(proc, _Trainer())
            tr.metrics.update(metrics)
            step = rec.get("step")
            if isinstance(step, int):
                tr.note_step(step, t)
                reward = as_float(metrics.get(METRICS["reward_mean"]))
                if reward is not None:
                    tr.rewards.append((step, reward))
        elif kind == "alert" or (kind == "event" and rec.get("level") in ("warning", "error")):
            item = {"time": t, "proc": proc, "kind": kind, "level": rec.get("level"), "event": rec.get("event"),
                    "message": rec.get("message", ""), "step": rec.get("step")}
            if kind == "alert":
                item["target"] = rec.get("target")
                self._alerts.setdefault((str(rec.get("event")), str(rec.get("target"))), item)
            self._recent.append(item)
            if len(self._recent) > 2 * RECENT_KEEP:
                self._recent.sort(key=lambda r: r["time"] or 0.0)
                del self._recent[:-RECENT_KEEP]

    def _note_decode(self, proc: str, metrics: dict[str, Any]) -> None:
        got = {k: v for k, name in DECODE_METRICS.items() if (v := as_float(metrics.get(name))) is not None}
        if got:
            self._decode[proc] = got

    def _decode_snapshot(self, tr: _Trainer) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        for key, name in DECODE_METRICS.items():
            own = as_float(tr.metrics.get(name))
            workers = [m[key] for m in self._decode.values() if key in m]
            out[key] = own if own is not None else (sum(workers) / len(workers) if workers else None)
        return out

    def _read_heartbeats(self) -> None:
        seen = set()
        try:
            entries = list(os.scandir(self.rd.heartbeats))
        except OSError:
            entries = []
        for e in entries:
            if not e.name.endswith(".json") or e.name.startswith("."):
                continue
            proc = e.name[:-5]
            seen.add(proc)
            try:
                st = e.stat()
            except OSError:
                continue
            key = (st.st_mtime_ns, st.st_size, st.st_ino)
            cached = self._hb.get(proc)
            if cached is not None and cached[0] == key:
                continue
            try:
                rec = read_json(e.path)
            except (OSError, ValueError):
                continue  # keep the previous version; the writer renames atomically, so this is rare
            if isinstance(rec, dict):
                self._hb[proc] = (key, rec)
        for proc in set(self._hb) - seen:
            del self._hb[proc]

    def _read_launch(self) -> None:
        try:
            mtime = os.stat(self.rd.launch_record).st_mtime_ns
        except OSError:
            self._launch = None
            return
        if self._launch is not None and self._launch[0] == mtime:
            return
        try:
            rec = read_json(self.rd.launch_record)
        except (OSError, ValueError):
            return
        self._launch = (mtime, rec if isinstance(rec, dict) else {})

    # ------------------------------------------------------------------------------------------------ slurm
    def job_ids(self) -> list[str]:
        """Slurm job ids to ask ``squeue`` about (only when launch.json says the executor is Slurm)."""
        launch = self._launch[1] if self._launch else {}
        if launch.get("executor") != "slurm":
            return []
        ids: set[str] = set()
        for job in launch.get("jobs") or []:
            jid = job.get("job_id", job.get("id")) if isinstance(job, dict) else job
            if jid not in (None, ""):
                ids.add(str(jid))
        for _, hb in self._hb.values():
            if hb.get("slurm_job_id"):
                ids.add(str(hb["slurm_job_id"]))
        return sorted(ids)

    # ------------------------------------------------------------------------------------------------ snapshot
    def refresh(self) -> dict[str, Any]:
        """Read what changed and return a snapshot (with Slurm states, rate-limited by the poller)."""
        self.update()
        return self.snapshot(self.slurm.states(self.job_ids()))

    def trainer_proc(self) -> str | None:
        for proc in TRAINER_PROCS:
            if proc in self._trainers:
                return proc
        return next((p for p in TRAINER_PROCS if p in self._hb), None)

    def snapshot(self, slurm_states: dict[str, str] | None = None, *, now: float | None = None) -> dict[str, Any]:
        """The run's state as a JSON-ready dict (non-finite numbers stay floats; see :func:`json_safe`)."""
        now = time.time() if now is None else now
        cfg = self.config or {}
        roles = self._roles(slurm_states or {}, now)
        tproc = self.trainer_proc()
        tr = self._trainers.setdefault(tproc, _Trainer()) if tproc else _Trainer()
        hb = self._hb[tproc][1] if tproc in self._hb else {}
        if isinstance(hb.get("step"), int) and (tr.step is None or hb["step"] > tr.step):
            tr.note_step(hb["step"], hb.get("time"))
        total = cfg.get("num_steps") if isinstance(cfg.get("num_steps"), int) else None
        status = self._status()
        state = self._run_state(status, roles)
        snap: dict[str, Any] = {
            "run_dir": str(self.rd.root), "run_id": self.info.get("run_id"), "name": cfg.get("name",
                                                                                         self.info.get("name")),
            "mode": cfg.get("mode"), "state": state, "ended": status is not None, "time": now,
            "step": tr.step, "total_steps": total,
            "progress": (tr.step / total) if total and tr.step is not None else None,
        }
        snap["eta_s"] = self._eta(tr, total) if state == "running" else None
        for key, name in METRICS.items():
            snap[key] = as_float(tr.metrics.get(name))
        snap.update(self._decode_snapshot(tr))
        snap["reward_trend"] = slope(list(tr.rewards)[-20:])
        snap.update(self._eval_summary())
        snap["weight_version"] = self._weight_version(tr)
        snap["trainer_proc"] = tproc
        snap["trainer_state"] = roles[tproc]["state"] if tproc in roles else None
        snap["last_progress_time"] = last_progress(tr.progress_time, hb.get("started"))
        snap["metrics"] = dict(tr.metrics)
        snap["roles"] = roles
        recent = sorted(self._recent, key=lambda r: r["time"] or 0.0)[-20:]
        snap["recent"] = recent
        snap["alerts"] = list(self._alerts.values())
        snap["monitor"] = {"dead_after_s": self.monitor_cfg.dead_after_s,
                           "stall_minutes": self.monitor_cfg.stall_minutes}
        snap["lines_read"] = self._events.lines
        snap["bad_lines"] = self._events.bad_lines
        return snap

    def _eval_summary(self) -> dict[str, Any]:
        """The held-out evaluations so far (``eval/vNNNNNN.json``): the newest one's accuracy and version, and the
        first one's accuracy (None when there is none)."""
        from relax_hpc.eval.evaluator import read_results

        evals = read_results(self.rd)
        if not evals:
            return {"eval_accuracy": None, "eval_version": None, "eval_first_accuracy": None}
        first, last = evals[min(evals)], evals[max(evals)]
        return {"eval_accuracy": last.get("eval/accuracy"), "eval_version": max(evals),
                "eval_first_accuracy": first.get("eval/accuracy")}

    def _roles(self, slurm_states: dict[str, str], now: float) -> dict[str, dict[str, Any]]:
        dead_after = self.monitor_cfg.dead_after_s
        roles: dict[str, dict[str, Any]] = {}
        for proc, (_, hb) in sorted(self._hb.items()):
            t = hb.get("time")
            age = max(0.0, now - float(t)) if isinstance(t, int | float) else None
            hb_state = str(hb.get("state") or "unknown")
            dead = hb_state != "stopped" and (age is None or age > dead_after)
            job = hb.get("slurm_job_id")
            array_id = (f"{hb['slurm_array_job_id']}_{hb['slurm_array_task_id']}"
                        if hb.get("slurm_array_job_id") and hb.get("slurm_array_task_id") is not None else None)
            roles[proc] = {
                "role": hb.get("role"), "rank": hb.get("rank"), "state": "dead" if dead else hb_state,
                "heartbeat_state": hb_state, "heartbeat_age_s": None if age is None else round(age, 2),
                "host": hb.get("host"), "pid": hb.get("pid"), "step": hb.get("step"), "version": hb.get("version"),
                "slurm_job_id": array_id or job,
                "slurm_state": slurm_states.get(array_id or "") or slurm_states.get(str(job)) if job else None,
            }
        launch = self._launch[1] if self._launch else {}
        for item in launch.get("procs") or []:
            name = item.get("proc", item.get("name")) if isinstance(item, dict) else item
            if isinstance(name, str) and name not in roles:
                role, _, rank = name.rpartition("-")
                roles[name] = {"role": role or name, "rank": int(rank) if rank.isdigit() else None,
                               "state": "waiting", "heartbeat_state": None, "heartbeat_age_s": None, "host": None,
                               "pid": item.get("pid") if isinstance(item, dict) else None, "step": None,
                               "version": None, "slurm_job_id": None, "slurm_state": None}
        return roles

    def _status(self) -> dict[str, Any] | None:
        try:
            status = read_json(self.rd.status_file, default=None)
        except (OSError, ValueError):
            return None
        return status if isinstance(status, dict) else None

    @staticmethod
    def _run_state(status: dict[str, Any] | None, roles: dict[str, dict[str, Any]]) -> str:
        if status is not None:
            return str(status.get("state") or "ended")
        states = [r["state"] for r in roles.values() if r["heartbeat_state"] is not None]
        if not states:
            return "pending"
        if any(s in LIVE_STATES for s in states):
            return "running"
        if all(s == "stopped" for s in states):
            return "stopped"
        return "stale"

    @staticmethod
    def _eta(tr: _Trainer, total: int | None) -> float | None:
        if total is None or tr.step is None:
            return None
        pts = list(tr.step_times)[-20:]
        per_step = None
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
            per_step = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
        if per_step is None:
            per_step = as_float(tr.metrics.get(METRICS["step_time"]))
        if per_step is None or not math.isfinite(per_step):
            return None
        return max(0, total - tr.step) * per_step

    def _weight_version(self, tr: _Trainer) -> int | None:
        v = as_float(tr.metrics.get("weights/version"))
        if v is not None and math.isfinite(v):
            return int(v)
        try:
            return int(self.rd.weights_latest.read_text().strip().lstrip("v"))
        except (OSError, ValueError):
            return None
