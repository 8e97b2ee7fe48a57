"""Admission control lives in :mod:`relax_hpc.rollout.admission` (the rollout driver uses it)."""

from relax_hpc.rollout.admission import Admission

__all__ = ["Admission"]
