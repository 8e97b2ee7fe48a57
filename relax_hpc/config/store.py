"""The ``store`` section: the sharded sample store."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from relax_hpc.config.base import Section


class StoreConfig(Section):
    """The sharded sample store."""

    retention: Literal["delete", "keep"] = "delete"
    """Consumed shards are deleted once a checkpoint covers them, or kept (debugging)."""
    stale_policy: Literal["drop", "flag"] = "drop"
    """Samples older than ``max_staleness`` versions: dropped (and counted), or kept and flagged: the trainer clips
    their ratio around its own current log-probs and weights their tokens by the truncated importance weight
    ``min(exp(logp_now - logp_rollout), algorithm.tis_cap)``."""
    wait_timeout_s: float = Field(1800.0, gt=0)
    """How long the trainer waits for samples before failing the run."""
    keep_plans: int = Field(16, ge=0)
    """Batch plans (which groups each step trained on) kept below the committed step; older ones are deleted at
    each commit. A large value keeps the whole audit trail that ``relax_hpc.store.audit`` checks (the chaos
    bench keeps every plan)."""
