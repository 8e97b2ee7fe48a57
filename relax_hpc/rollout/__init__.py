"""Rollout: generation engines (``hf`` in-process, ``sglang`` a server per node) and the rollout worker."""
