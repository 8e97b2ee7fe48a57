"""Exit codes of role processes, shared by the roles and the launchers."""

EXIT_OK = 0
"""The role finished its work."""
EXIT_FAILED = 1
"""The role failed (the run should stop)."""
EXIT_USER_ERROR = 2
"""Bad input (config, paths); the message is one line on stderr."""
EXIT_REQUEUE = 3
"""The role was signalled (SIGUSR2 / SIGTERM), wrote a checkpoint and wants to be restarted (requeued)."""
