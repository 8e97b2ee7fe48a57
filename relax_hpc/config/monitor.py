"""The ``monitor`` section: metrics sinks and alerts."""

from __future__ import annotations

from pydantic import Field

from relax_hpc.config.base import Section


class MonitorConfig(Section):
    """Metrics sinks and alerts."""

    tensorboard: bool = False
    """Also write TensorBoard event files to ``RUN_DIR/logs/tensorboard``."""
    wandb: bool = False
    """Also log to Weights & Biases (offline mode unless WANDB_MODE says otherwise)."""
    wandb_project: str = "relax-hpc"
    """W&B project."""
    alert_urls: list[str] = Field(default_factory=list)
    """Apprise URLs notified on a dead role, a NaN loss or a stall (always also written to the event log)."""
    stall_minutes: float = Field(15.0, gt=0)
    """No trainer progress for this long raises a stall alert."""
    dead_after_s: float = Field(120.0, gt=0)
    """A heartbeat older than this marks a role dead."""
    reward_error_alert: float = Field(0.5, ge=0.0, le=1.0)
    """Alert when the reward function fails on more than this fraction of the samples of the last few steps."""
    truncation_alert: float = Field(0.9, ge=0.0, le=1.0)
    """Alert when more than this fraction of the last few steps' responses hit ``max_new_tokens``."""
