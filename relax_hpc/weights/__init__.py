"""Versioned weight snapshots in ``RUN_DIR/weights``: the trainer publishes, rollout workers poll and load.

See ``docs/protocol.md`` for the on-disk protocol. torch is imported lazily, so this package imports without it.
"""

from relax_hpc.weights.delta import DeltaPolicy, delta_policy
from relax_hpc.weights.manifest import complete_versions, latest_version
from relax_hpc.weights.publisher import Shard, SnapshotPublisher, default_token
from relax_hpc.weights.reader import Snapshot, SnapshotReader, Verify, copy_state_into, load_snapshot
from relax_hpc.weights.retention import apply_retention, live_leases, pin, pinned_versions, unpin

__all__ = [
    "DeltaPolicy",
    "Shard",
    "Snapshot",
    "SnapshotPublisher",
    "SnapshotReader",
    "Verify",
    "apply_retention",
    "complete_versions",
    "copy_state_into",
    "default_token",
    "delta_policy",
    "latest_version",
    "live_leases",
    "load_snapshot",
    "pin",
    "pinned_versions",
    "unpin",
]
