"""The sharded HDF5 sample store between rollout workers and the trainer (numpy + h5py; never imports torch).

Writers publish shards of complete prompt groups atomically (:class:`ShardWriter`); the ranks of a consumer group read
every sample exactly once through batch plans (:class:`ConsumerGroup`), with the read position committed together
with the trainer's checkpoint. Writers throttle on :func:`backlog`. The on-disk protocol is in
``docs/protocol-samples.md``.
"""

from relax_hpc.store.backlog import BacklogInfo, backlog
from relax_hpc.store.consumer import ConsumerGroup
from relax_hpc.store.layout import ShardRef, quarantine
from relax_hpc.store.plan import Plan
from relax_hpc.store.sample import Sample, SampleGroup, to_torch
from relax_hpc.store.shard_reader import read_shard
from relax_hpc.store.writer import ShardInfo, ShardWriter, new_writer_id

__all__ = [
    "BacklogInfo",
    "ConsumerGroup",
    "Plan",
    "Sample",
    "SampleGroup",
    "ShardInfo",
    "ShardRef",
    "ShardWriter",
    "backlog",
    "new_writer_id",
    "quarantine",
    "read_shard",
    "to_torch",
]
