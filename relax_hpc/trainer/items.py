"""Store samples -> trainer items: each item is the sample record itself with room for its advantage."""

from __future__ import annotations

from collections.abc import Sequence

from relax_hpc.record import Sample
from relax_hpc.trainer.batch import TrainItem


def samples_to_items(samples: Sequence[Sample]) -> list[TrainItem]:
    """One :class:`TrainItem` per store sample, in order (the samples are not copied); a sample read with ``stale``
    set (``stale_policy: flag``) is a stale item, which the trainer re-weights by importance sampling."""
    return [TrainItem(s) for s in samples]
