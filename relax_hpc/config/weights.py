"""The ``weights`` section: how new weights reach the rollout engines."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from relax_hpc.config.base import Section


class AutoTransport(Section):
    """``weights.transport.kind: auto``: chosen by the mode and the engine: ``memory`` in colocate,
    ``process_group`` for an in-process engine in fully_async, ``files`` for a server engine (the deprecated keys
    ``weights.fast_path``, ``weights.files_every_s`` and ``rollout.server.weight_sync`` still steer it)."""

    kind: Literal["auto"] = "auto"


class FilesTransport(Section):
    """``weights.transport.kind: files``: every published version only as snapshot files; engines load them."""

    kind: Literal["files"]


class ProcessGroupTransport(Section):
    """``weights.transport.kind: process_group`` (fully_async, in-process engines): trainer rank 0 sends each new
    version over a process group per rollout worker; the snapshot files stay the truth (late joiners, recovery)."""

    kind: Literal["process_group"]
    backend: Literal["auto", "gloo"] = "auto"
    """``auto``: NCCL for GPU models, gloo on the CPU; ``gloo``: GPU weights through host memory over TCP (roles
    sharing one GPU, which NCCL refuses, or nodes without a common NCCL fabric)."""
    files_every_s: float = Field(10.0, ge=0)
    """While every worker takes the process group: write a published version's files only if this many seconds
    passed since the last ones (the last step's always); 0: always."""


class ServerTransport(Section):
    """``weights.transport.kind: server`` (fully_async, server engines): trainer rank 0 broadcasts each version into
    the rollout servers (SGLang ``/update_weights_from_distributed``); every version's files are written too and any
    failure falls back to them (an event says so)."""

    kind: Literal["server"]


class MemoryTransport(Section):
    """``weights.transport.kind: memory`` (colocate): the in-process engine generates with the trainer's module (or
    a copy handed over in memory); snapshot files are written every ``publish_every`` steps in the background."""

    kind: Literal["memory"]


WeightTransport = Annotated[AutoTransport | FilesTransport | ProcessGroupTransport | ServerTransport | MemoryTransport,
                            Field(discriminator="kind")]
"""``weights.transport``: how new weights reach the engines (:mod:`relax_hpc.weights.transport`)."""


class DeltaConfig(Section):
    """``weights.delta``: write versions as the difference from the last full version (see docs/protocol.md,
    "Delta snapshots"); readers reconstruct them from that base."""

    every_full: int = Field(20, ge=1)
    """A full version every this many versions (1: always full); the deltas in between are against it. 20: about
    10 % of the full size per version on a real model at lr 1e-6 (docs/protocol.md, "Delta snapshot figures")."""
    max_fraction: float = Field(0.5, gt=0, le=1)
    """Write a version full whenever its delta would be larger than this fraction of the full size."""
    codec: Literal["xor-zstd", "sparse"] = "xor-zstd"
    """``xor-zstd``: changed bits, zstd-compressed; ``sparse``: (uint32 index, value) of each changed element."""


class WeightSyncConfig(Section):
    """How new weights reach the rollout engines."""

    transport: WeightTransport = Field(default_factory=AutoTransport)
    """How new weights reach the rollout engines, by ``kind``: ``auto``, ``files``, ``process_group``, ``server``,
    ``memory`` (see docs/protocol.md, "Weight transport")."""

    delta: DeltaConfig | None = None
    """Delta snapshots (off by default): ``{every_full: K, max_fraction: f}``."""
    publish_every: int = Field(1, ge=1)
    """Publish a weight snapshot every N trainer steps."""
    keep_last: int = Field(3, ge=1)
    """Snapshots kept (plus pinned ones and any a reader holds a lease on)."""
    fast_path: Literal["auto", "gloo", "off"] = "auto"
    """Deprecated: use ``weights.transport`` (``off`` = ``files``, ``auto``/``gloo`` = ``process_group`` with that
    backend). Also send new weights over a process group when trainer rank 0 and the rollout workers can form one (the
    snapshot on disk stays the truth for late joiners and recovery): ``auto`` uses NCCL for GPU models and gloo on
    CPU; ``gloo`` sends GPU weights through host memory over TCP (roles sharing one GPU, which NCCL refuses, or nodes
    without a common NCCL fabric)."""
    verify: Literal["sha256", "size"] = "sha256"
    """How readers verify a snapshot before loading it."""
    files_every_s: float = Field(10.0, ge=0)
    """Deprecated: use ``weights.transport.files_every_s`` (``kind: process_group``). fully_async, while the fast path
    serves every rollout worker: write the snapshot files of a published version
    only if this many seconds passed since the last ones (the last step's always). Any worker off the fast path
    (starting, restarted, link down) makes every published version go to the files again. 0: always write them."""

    @field_validator("fast_path", mode="before")
    @classmethod
    def _yaml_bool(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` (and `on`) as a boolean
        return {False: "off", True: "auto"}.get(v, v) if isinstance(v, bool) else v
