"""The exception hierarchy. User-facing problems are :class:`UserError` (the CLI prints one line, exits 2)."""

from __future__ import annotations


class RelaxError(Exception):
    """Base class of every error relax-hpc raises on purpose."""


class UserError(RelaxError, ValueError):
    """Bad input from the user (recipe, CLI flag, path). The CLI prints ``error: <message>`` and exits 2."""


class ConfigError(UserError):
    """A recipe or override that does not validate. ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class RunDirError(UserError):
    """A folder that is not a run dir, holds another run, or cannot be written."""


class StateFileError(RunDirError):
    """A run-dir state file (JSON) that exists but cannot be read: garbage, truncated, not UTF-8, a pickle, the
    wrong shape. Raised only by :func:`relax_hpc.fsio.read_json`; the message names the file."""

    def __init__(self, path: object, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"cannot read {path}: {reason}")


class StoreError(RelaxError):
    """A sample-store problem that is not the user's input (e.g. an unreadable shard)."""


class SampleValidationError(UserError):
    """A sample with a wrong dtype, shape or a missing key, rejected before anything is written."""


class CorruptShardError(StoreError):
    """A shard whose checksum or structure does not match; it gets quarantined, never counted as consumed."""


class SnapshotError(RelaxError):
    """A weight snapshot that is incomplete or fails verification."""


class WaitTimeout(RelaxError, TimeoutError):
    """A bounded wait ran out. The message says what was waited for and for how long."""
