"""Run modes: ``colocate`` (one group generates then trains) and ``fully_async`` (trainer and rollout roles)."""
