"""RL objectives. ``registry`` maps names to algorithm modules (no torch); ``base`` is the trainer's interface."""
