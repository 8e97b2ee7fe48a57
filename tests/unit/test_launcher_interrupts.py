"""The local launcher's signals (launch/local.py ``Interrupts``, ``terminate``), on real processes: the first Ctrl-C
or SIGTERM stops the run (KeyboardInterrupt), a second while the roles checkpoint stops them at once, and the
launcher returns only when every role has exited; after the run has stopped, signals are only counted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from relax_hpc.launch.local import Interrupts, LocalProc, pid_alive, terminate

SLOW_TO_STOP = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *a: None)  # a role checkpointing for a long while\n"
                "print('ready', flush=True)\n"
                "time.sleep(120)\n")


def slow_role() -> LocalProc:
    p = subprocess.Popen([sys.executable, "-c", SLOW_TO_STOP], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"  # its SIGTERM handler is in place
    return LocalProc("trainer", 0, p)


def test_a_second_interrupt_while_the_roles_checkpoint_stops_them_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    procs = [slow_role(), slow_role()]
    interrupts = Interrupts()
    interrupts.count = 1  # the first Ctrl-C started the stop
    threading.Timer(0.5, interrupts.handler, args=(signal.SIGINT, None)).start()  # the second, 0.5 s later
    t0 = time.monotonic()
    terminate(procs, timeout_s=60, interrupts=interrupts)
    took = time.monotonic() - t0
    assert took < 20, took  # not the 60 s the roles were given
    assert all(p.popen.returncode == -signal.SIGKILL for p in procs)
    assert not any(pid_alive(p.popen.pid) for p in procs)
    assert "interrupted again: stopping the roles now" in capsys.readouterr().err


def test_without_a_second_interrupt_the_roles_get_their_time_then_sigkill() -> None:
    procs = [slow_role()]
    t0 = time.monotonic()
    terminate(procs, timeout_s=1.0, interrupts=Interrupts())
    assert 1.0 <= time.monotonic() - t0 < 15
    assert procs[0].popen.returncode == -signal.SIGKILL


def test_the_first_signal_raises_later_ones_do_not_and_settled_ones_never() -> None:
    it = Interrupts()
    with pytest.raises(KeyboardInterrupt):
        it.handler(signal.SIGTERM, None)
    it.handler(signal.SIGTERM, None)  # the second: counted, not raised (terminate reads the count)
    assert it.count == 2
    quiet = Interrupts()
    quiet.settle()
    quiet.handler(signal.SIGINT, None)
    assert quiet.count == 1


def test_install_takes_sigterm_and_sigint_but_leaves_an_ignored_sigint_alone() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    it = Interrupts().install()
    try:
        assert signal.getsignal(signal.SIGTERM) == it.handler and signal.getsignal(signal.SIGINT) == it.handler
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs in the main thread between bytecodes
    finally:
        it.restore()
    assert {s: signal.getsignal(s) for s in before} == before
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        it = Interrupts().install()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        it.restore()
    finally:
        signal.signal(signal.SIGINT, before[signal.SIGINT])
