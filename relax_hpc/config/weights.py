"""The ``weights`` section: how new weights reach the rollout engines."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from relax_hpc.config.base import Section


class WeightSyncConfig(Section):
    """How new weights reach the rollout engines."""

    publish_every: int = Field(1, ge=1)
    """Publish a weight snapshot every N trainer steps."""
    keep_last: int = Field(3, ge=1)
    """Snapshots kept (plus pinned ones and any a reader holds a lease on)."""
    fast_path: Literal["auto", "gloo", "off"] = "auto"
    """Also send new weights over a process group when trainer rank 0 and the rollout workers can form one (the
    snapshot on disk stays the truth for late joiners and recovery): ``auto`` uses NCCL for GPU models and gloo on
    CPU; ``gloo`` sends GPU weights through host memory over TCP (roles sharing one GPU, which NCCL refuses, or nodes
    without a common NCCL fabric)."""
    verify: Literal["sha256", "size"] = "sha256"
    """How readers verify a snapshot before loading it."""
    files_every_s: float = Field(10.0, ge=0)
    """fully_async, while the fast path serves every rollout worker: write the snapshot files of a published version
    only if this many seconds passed since the last ones (the last step's always). Any worker off the fast path
    (starting, restarted, link down) makes every published version go to the files again. 0: always write them."""

    @field_validator("fast_path", mode="before")
    @classmethod
    def _yaml_bool(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` (and `on`) as a boolean
        return {False: "off", True: "auto"}.get(v, v) if isinstance(v, bool) else v
