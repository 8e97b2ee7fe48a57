"""Runs that cannot learn, reported loudly: checks of each step's metrics, called from one line where a role logs
them (the trainer session; a rollout worker's metrics too).

* A NaN/inf ``train/loss`` or ``train/grad_norm``: with ``trainer.on_nonfinite: stop`` (default) an ``alert``
  record and :class:`NonFiniteError` (the role fails, the run does not end "completed"); with ``skip`` the update is
  skipped (the trainer never applies a non-finite gradient), counted in ``train/nonfinite_skipped`` and alerted
  once; more than ``trainer.max_nonfinite_skips`` in a row stops the run.
* A reward that errors on most samples (``reward/errors`` / ``reward/samples`` over the last few records above
  ``monitor.reward_error_alert``): one ``reward_errors`` alert.
* Responses cut at ``max_new_tokens`` (``rollout/truncated_fraction`` above ``monitor.truncation_alert``): one
  ``responses_truncated`` alert.
* A train/rollout mismatch that jumps: one ``mismatch_jump`` alert. Judged is the on-policy part,
  ``train/mismatch_kl/staleness_0``, or ``train/mismatch_kl`` where a record has no staleness split (every sample
  on-policy), above ``MISMATCH_JUMP`` times the median of its previous records and above ``MISMATCH_FLOOR``, or above
  ``MISMATCH_CEILING`` at any time. A record of stale samples only (fully_async at ``max_staleness`` 1 trains on
  the previous version's samples) holds the policy's own step too, so its least stale part is judged against that
  same part's history, and never against the ceiling. The engine then samples from other weights than
  the trainer holds (a broken or partial weight sync, a dtype or kernel change), and importance sampling is
  correcting a difference it was not meant for.

Alerts are ``alert`` records in the role's event log (the monitor shows them and sends them to ``alert_urls``).
"""

from __future__ import annotations

import collections
import logging
import math
import re
from typing import Any, Protocol

from relax_hpc.errors import RelaxError

log = logging.getLogger(__name__)

NONFINITE_KEYS = ("train/loss", "train/grad_norm", "train/pg_loss")
WINDOW = 5
"""Metric records the reward-error and truncation fractions are taken over."""
MIN_SAMPLES = 16
"""Fewer samples than this in the window raise no fraction alert (too little to judge)."""
MISMATCH_JUMP = 10.0
"""A mismatch KL this many times the median of the previous records is a jump."""
MISMATCH_FLOOR = 1e-3
"""...when it is also above this (float32 numerics sit near 1e-7, bf16 near 1e-4)."""
MISMATCH_CEILING = 0.1
"""A mismatch KL above this alerts even without history (a weight sync broken from the first step)."""
MISMATCH_KEY = "train/mismatch_kl"
"""The mismatch of all samples of a step; ``MISMATCH_KEY/staleness_K`` its part of samples K versions stale
(``staleness_2plus``: 2 or more)."""
_STALENESS_PART = re.compile(re.escape(MISMATCH_KEY) + r"/staleness_(\d+)(?:plus)?")


class NonFiniteError(RelaxError):
    """A step produced a NaN/inf loss or gradient and the recipe says to stop."""


class AlertSink(Protocol):
    def alert(self, event: str, message: str, *, step: int | None = None, **fields: Any) -> None: ...


class RunHealth:
    """Per-process checker: :meth:`check` each step's metrics; it returns metrics to add (counters)."""

    def __init__(self, cfg: Any, events: AlertSink | None, *, emit: bool = True):
        self.cfg = cfg
        self.events = events
        self.emit = emit
        """Write alert records (rank 0 only; other ranks still raise)."""
        self.skipped = 0
        self.in_a_row = 0
        self.fired: set[str] = set()
        self._window: collections.deque[dict[str, float]] = collections.deque(maxlen=WINDOW)
        self._mismatch: dict[str, collections.deque[float]] = {}

    def _alert(self, event: str, message: str, step: int | None) -> None:
        if event in self.fired:
            return
        log.error("%s", message)
        if self.emit and self.events is not None:
            self.events.alert(event, message, step=step)
        self.fired.add(event)

    def check(self, metrics: dict[str, float], step: int | None) -> dict[str, float]:
        """Raise :class:`NonFiniteError` or fire alerts as the module docstring says; return counter metrics."""
        extra = self._nonfinite(metrics, step)
        self._window.append(metrics)
        self._fractions(step)
        self._mismatch_jump(metrics, step)
        return extra

    def _mismatch_jump(self, metrics: dict[str, float], step: int | None) -> None:
        key, on_policy = mismatch_part(metrics)
        if key is None or not math.isfinite(kl := float(metrics[key])):
            return
        seen = self._mismatch.setdefault(key, collections.deque(maxlen=WINDOW))
        history = sorted(seen)
        seen.append(kl)
        base = history[len(history) // 2] if history else None
        jumped = base is not None and kl > MISMATCH_FLOOR and kl > MISMATCH_JUMP * base
        if jumped or (on_policy and kl > MISMATCH_CEILING):
            was = f"from a median of {base:.3g} over the last {len(history)} records" if history else "at once"
            self._alert("mismatch_jump", f"{key} = {kl:.3g} at step {step} ({was}): the rollout engine samples "
                        "from other weights than the trainer holds (check the weight sync, the engine's dtype and "
                        "kernels)", step)

    def _nonfinite(self, metrics: dict[str, float], step: int | None) -> dict[str, float]:
        bad = {k: metrics[k] for k in NONFINITE_KEYS if k in metrics and not math.isfinite(float(metrics[k]))}
        if not bad:
            self.in_a_row = 0
            return {"train/nonfinite_skipped": float(self.skipped)} if self.skipped else {}
        what = ", ".join(f"{k} = {v}" for k, v in bad.items())
        tcfg = self.cfg.trainer
        if tcfg.on_nonfinite == "stop":
            msg = f"{what} at step {step}: stopping the run (trainer.on_nonfinite: stop)"
            self._alert("nonfinite_loss", msg, step)
            raise NonFiniteError(msg)
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row > tcfg.max_nonfinite_skips:
            msg = (f"{what} at step {step}: {self.in_a_row} non-finite steps in a row, more than "
                   f"trainer.max_nonfinite_skips={tcfg.max_nonfinite_skips}; stopping the run")
            self._alert("nonfinite_stopped", msg, step)
            raise NonFiniteError(msg)
        self._alert("nonfinite_skipped", f"{what} at step {step}: update skipped (trainer.on_nonfinite: skip; "
                    f"{self.skipped} skipped so far)", step)
        return {"train/nonfinite_skipped": float(self.skipped)}

    def _fractions(self, step: int | None) -> None:
        mcfg = self.cfg.monitor
        errors = sum(float(m.get("reward/errors", 0.0)) for m in self._window)
        scored = sum(float(m.get("reward/samples", 0.0)) for m in self._window)
        if scored >= MIN_SAMPLES and errors / scored > mcfg.reward_error_alert:
            self._alert("reward_errors", f"the reward function failed on {errors:.0f} of {scored:.0f} samples "
                        f"of the last {len(self._window)} records (reward.on_error: {self.cfg.reward.on_error}); "
                        "the run learns from errors, not from the task", step)
        cut = [(float(m["rollout/truncated_fraction"]), float(m.get("rollout/num_samples", 1.0)))
               for m in self._window if "rollout/truncated_fraction" in m]
        n = sum(w for _, w in cut)
        full = len(cut) == WINDOW  # judged over whole windows: the first steps of an untrained model run long
        if full and n >= MIN_SAMPLES and sum(f * w for f, w in cut) / n > mcfg.truncation_alert:
            frac = sum(f * w for f, w in cut) / n
            self._alert("responses_truncated", f"{frac:.0%} of responses hit rollout.sampling.max_new_tokens="
                        f"{self.cfg.rollout.sampling.max_new_tokens} (cut before they end): raise it, or "
                        "reward/penalise length (algorithm.overlong)", step)


def mismatch_part(metrics: dict[str, float]) -> tuple[str | None, bool]:
    """The mismatch key of a metrics record to judge, and whether it is on-policy (module docstring)."""
    parts = sorted((int(m[1]), k) for k in metrics if (m := _STALENESS_PART.fullmatch(k)))
    if not parts:
        return (MISMATCH_KEY, True) if MISMATCH_KEY in metrics else (None, False)
    staleness, key = parts[0]
    return key, staleness == 0
