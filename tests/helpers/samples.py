"""Sample groups for the store tests."""

from __future__ import annotations

import numpy as np

from relax_hpc.store import Sample, SampleGroup


def group(gid: str, n: int = 4, version: int = 0, length: int = 5) -> SampleGroup:
    samples = [
        Sample(
            prompt_ids=np.arange(3, dtype=np.int32),
            response_ids=np.full(length, i, np.int32),
            logprobs=np.zeros(length, np.float32),
            reward=float(i),
            version=version,
            metadata={"uid": f"{gid}/{i}"},
        )
        for i in range(n)
    ]
    return SampleGroup(gid, samples)


def uids(samples: list[Sample]) -> list[str]:
    return [s.metadata["uid"] for s in samples]
