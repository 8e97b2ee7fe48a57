"""Process lifecycle shared by every role and launcher: exit codes and the preemption stop flag.

A low layer (standard library only), so the role loops in ``modes/`` and the launchers in ``launch/`` both import it.

Preemption signals: SIGUSR2 (what our sbatch scripts ask Slurm for; NCCL may catch USR1) and SIGTERM (scancel,
``scontrol requeue``, the local launcher) set a flag; the role checkpoints at the next safe point and exits 3.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger(__name__)

EXIT_OK = 0
"""The role finished its work."""
EXIT_FAILED = 1
"""The role failed (the run should stop)."""
EXIT_USER_ERROR = 2
"""Bad input (config, paths); the message is one line on stderr."""
EXIT_REQUEUE = 3
"""The role was signalled (SIGUSR2 / SIGTERM), wrote a checkpoint and wants to be restarted (requeued)."""


class StopFlag:
    """Set by SIGUSR2/SIGTERM/SIGINT; the role polls :attr:`is_set` between steps."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)):
        self._event = threading.Event()
        self.signum: int | None = None
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                signal.signal(s, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._event.is_set():
            log.warning("received %s: will checkpoint and exit at the next safe point", signal.Signals(signum).name)
        self.signum = signum
        self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``, waking early when a signal arrives. Returns whether it is set."""
        return self._event.wait(timeout_s)
