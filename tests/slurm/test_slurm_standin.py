"""A stand-in for ``python -m relax_hpc role ...`` used by the Slurm plumbing tests (no tests in this file).

The rendered sbatch scripts run ``"$RELAX_PYTHON" -m relax_hpc role ROLE --run-dir DIR [--rank N]``; the tests
render them with an interpreter (``launch(python=...)`` or ``$RELAX_HPC_PYTHON``) that runs this program instead, so
that Slurm's side (placements, ranks, signals, requeues, arrays, drains) is tested in seconds without any model. It
keeps the role contract:

* trainer / colocate: ``num_steps`` steps (from ``config.json``) of ``$STANDIN_STEP_S`` seconds; a checkpoint
  (``checkpoints/LATEST`` holding the step) every step; resumes from it; on SIGUSR2/SIGTERM it checkpoints and exits
  3; at the end writes ``STATUS.json`` and exits 0. A trainer of a fully_async run first waits (bounded) for
  ``rollout.num_workers`` rollout heartbeats.
* rollout: beats until ``STATUS.json`` appears (exit 0), a drain request arrives (exit 0) or SIGUSR2/SIGTERM (exit 3);
  with STANDIN_ROLLOUT_FAIL=1 in its environment it fails (exit 1) as soon as the trainer runs (its signal handlers
  set: a trainer still starting would die of the script's SIGUSR2 instead of checkpointing).

Every incarnation logs an ``incarnation`` event with its Slurm ids and the step it resumed from.
"""

from __future__ import annotations

import os
import signal
import sys
import time

STEP_S = float(os.environ.get("STANDIN_STEP_S", "0.5"))


def main(argv: list[str]) -> int:
    from relax_hpc.events import EventLog, Heartbeat
    from relax_hpc.fsio import atomic_write_json, atomic_write_text, read_json
    from relax_hpc.rundir import RunDir, proc_name

    if argv[:3] != ["-m", "relax_hpc", "role"]:  # anything else (the sweep's manifest lookup): the real python
        os.execv(sys.executable, [sys.executable, *argv])
    role, rest = argv[3], argv[4:]
    run_dir = RunDir.open(rest[rest.index("--run-dir") + 1])
    if "--rank" in rest:
        rank = int(rest[rest.index("--rank") + 1])
    else:
        rank = int(os.environ.get("SLURM_PROCID", "0"))
    cfg = read_json(run_dir.config)
    stop = {"sig": None}

    def handler(signum: int, frame: object) -> None:
        stop["sig"] = signal.Signals(signum).name

    for s in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(s, handler)
    log = EventLog(run_dir, role, rank)
    hb = Heartbeat(run_dir, role, rank, min_interval_s=0.0)
    proc = proc_name(role, rank)
    if role == "rollout":
        log.event("incarnation", ntasks=os.environ.get("SLURM_NTASKS"), argv=argv)
        hb.beat(state="running")
        if os.environ.get("STANDIN_ROLLOUT_FAIL") == "1":  # set through launch.rollout.env by a test
            trainer_up = run_dir.event_log("trainer-0")  # written after its signal handlers are set
            end = time.monotonic() + 60
            while not trainer_up.exists() and time.monotonic() < end:
                time.sleep(0.1)
            log.event("failing")
            hb.stop("failed")
            return 1
        end = time.monotonic() + 600
        while time.monotonic() < end:
            if stop["sig"]:
                log.event("stopped", signal=stop["sig"])
                hb.stop("stopped")
                return 3
            req = read_json(run_dir.control_file(proc), default=None)
            if isinstance(req, dict) and req.get("action") == "drain":
                log.event("drained")
                hb.stop("stopped")
                return 0
            if run_dir.status_file.exists():
                log.event("done")
                hb.stop("stopped")
                return 0
            hb.beat(state="running")
            time.sleep(0.2)
        return 1
    latest = run_dir.checkpoints_latest
    start = int(latest.read_text()) if latest.exists() else 0
    log.event("incarnation", resumed_from=start, ntasks=os.environ.get("SLURM_NTASKS"), argv=argv)
    if cfg["mode"] == "fully_async" and rank == 0:
        want = cfg["rollout"]["num_workers"]
        end = time.monotonic() + 60
        while len(list(run_dir.heartbeats.glob("rollout-*.json"))) < want and time.monotonic() < end:
            if stop["sig"]:
                break
            time.sleep(0.1)
    lr = float(cfg["algorithm"]["clip_high"]) * 10 + float(cfg["trainer"]["lr"]) * 1e5
    for step in range(start + 1, cfg["num_steps"] + 1):
        hb.beat(state="running", step=step - 1)
        t_end = time.monotonic() + STEP_S
        while time.monotonic() < t_end and not stop["sig"]:
            time.sleep(0.05)
        if stop["sig"]:
            if rank == 0:
                atomic_write_text(latest, str(step - 1))
            log.event("checkpointed", step=step - 1, signal=stop["sig"])
            hb.stop("stopped")
            return 3
        if rank == 0:
            atomic_write_text(latest, str(step))
        log.metrics({"rollout/reward": lr + step / 100.0, "perf/step_time": STEP_S}, step=step)
    if rank == 0:
        atomic_write_json(run_dir.status_file, {"state": "completed", "steps": cfg["num_steps"],
                                                "time": time.time()})
    hb.stop("stopped")
    log.event("finished", step=cfg["num_steps"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
