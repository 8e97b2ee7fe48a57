"""Launching roles: local processes (the embedded default) or Slurm jobs."""
