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
    # as a terminal starts the launcher (a CI runner's background job may start this suite with SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    it = Interrupts().install()
    try:
        assert signal.getsignal(signal.SIGTERM) == it.handler and signal.getsignal(signal.SIGINT) == it.handler
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs in the main thread between bytecodes
    finally:
        it.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        it = Interrupts().install()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        it.restore()
    finally:
        signal.signal(signal.SIGINT, before[signal.SIGINT])


def exits_after(seconds: float) -> LocalProc:
    p = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"], start_new_session=True)
    return LocalProc("rollout", 0, p)


def test_after_the_trainer_the_workers_end_by_themselves_within_their_grace() -> None:
    """The trainer has finished: a worker that ends by itself (the final evaluation done) is waited for, not
    stopped; one that does not end is waited for only up to its own grace; a Ctrl-C stops the waiting."""
    from relax_hpc.launch.local import await_helpers

    done_soon, never = exits_after(1.0), slow_role()
    t0 = time.monotonic()
    await_helpers([done_soon, never], lambda p: 30.0 if p is done_soon else 2.0, Interrupts())
    took = time.monotonic() - t0
    assert 1.0 <= took < 20, took
    assert done_soon.popen.returncode == 0 and never.popen.poll() is None  # waited for the one; the other left
    it = Interrupts()
    it.settle()  # counted only (as on a thread that is not the main one, where it would raise)
    threading.Timer(0.5, it.handler, args=(signal.SIGINT, None)).start()
    t0 = time.monotonic()
    await_helpers([never], lambda p: 60.0, it)  # the interrupt stops the waiting, not the 60 s
    assert it.count == 1 and time.monotonic() - t0 < 20
    terminate([never], timeout_s=0.5)
    assert never.popen.returncode == -signal.SIGKILL


def test_the_evaluating_worker_gets_the_final_evaluations_time() -> None:
    from relax_hpc.config.load import validate_dict
    from relax_hpc.roles.spec import ROLLOUT_GRACE_S, rollout_grace_s

    base = {"model": {"path": "tiny"}, "data": {"task": {"name": "reverse_digits"}}, "mode": "fully_async"}
    with_eval = validate_dict({**base, "eval": {"data": {"task": {"name": "reverse_digits"}}, "worker": 1,
                                                "end_timeout_s": 300}})
    assert rollout_grace_s(with_eval, "rollout", 1) == ROLLOUT_GRACE_S + 300  # the evaluating worker
    assert rollout_grace_s(with_eval, "rollout", 0) == ROLLOUT_GRACE_S
    assert rollout_grace_s(with_eval, "trainer", 1) == ROLLOUT_GRACE_S
    assert rollout_grace_s(with_eval) == ROLLOUT_GRACE_S + 300  # all workers as one Slurm step
    no_end = validate_dict({**base, "eval": {"data": {"task": {"name": "reverse_digits"}}, "at_end": False}})
    assert rollout_grace_s(no_end, "rollout", 0) == rollout_grace_s(validate_dict(base), "rollout", 0) \
        == ROLLOUT_GRACE_S


def test_supervise_waits_for_the_evaluating_worker_after_the_trainer_has_finished(tmp_path) -> None:
    """The local launcher, once the trainer exits 0, lets a rollout worker that is still busy (the final
    evaluation) end by itself instead of stopping it at once."""
    from relax_hpc.config.load import validate_dict
    from relax_hpc.launch.local import supervise
    from relax_hpc.rundir import RunDir

    rd = RunDir.create(tmp_path / "run")
    cfg = validate_dict({"model": {"path": "tiny"}, "data": {"task": {"name": "reverse_digits"}},
                         "mode": "fully_async", "eval": {"data": {"task": {"name": "reverse_digits"}}}})
    trainer = LocalProc("trainer", 0, subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True))
    script = ("import signal, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: (print('stopped early', flush=True), exit(15)))\n"
              "time.sleep(3)  # the final evaluation\n")
    worker = LocalProc("rollout", 0, subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                                      text=True, start_new_session=True))
    assert supervise(rd, cfg, [trainer, worker], poll_s=0.1, interrupts=Interrupts()) == 0
    assert worker.popen.returncode == 0 and worker.popen.stdout is not None
    assert "stopped early" not in worker.popen.stdout.read()
