"""Chaos on real Slurm: demo-sized fully_async runs whose roles are killed, requeued and cancelled at random times;
every run must complete (resumed when its jobs end without completing), and the sample store's accounting must
show that no sample was lost or consumed twice.

For each run (several at once on the cluster's nodes), at random intervals once its trainer is up, one of:

* ``SIGKILL`` of a random role process (the trainer or a rollout worker; the pid of its heartbeat, checked to be a
  live ``relax_hpc role`` process of this machine: the local cluster's nodes are this machine). The role
  supervisor of its Slurm task starts it again (:mod:`relax_hpc.launch.supervisor`);
* ``scontrol requeue`` of one of the run's jobs (the trainer checkpoints on SIGTERM and resumes);
* ``scancel`` of one job step (the script starts an ended rollout step again; a cancelled trainer step requeues
  the job).

A run whose jobs all ended without ``STATUS.json`` saying completed is resumed (``relax-hpc resume``). At the end
every run's store is audited (:func:`relax_hpc.store.audit.audit`: the chain of committed batch plans against every
published shard), and the trained groups are checked against ``num_steps x prompts_per_step``.

``relax-hpc bench chaos [--json] [--runs 20] [--kills 100] [--parallel 4]`` prints runs, kills, requeues, step
cancels, resumes, completed, and samples produced / consumed / dropped / quarantined / unread / duplicated / lost.
Every job it submitted is cancelled by id at the end. When runs complete before their share of ``--kills`` landed,
the share passes to later runs, and up to ``--runs // 2`` runs more are submitted until ``--kills`` have landed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_hpc.errors import UserError
from relax_hpc.fsio import read_json
from relax_hpc.launch import slurm_cli
from relax_hpc.roles import spec as roles
from relax_hpc.rundir import RunDir, proc_name

DEMO = Path(__file__).resolve().parent.parent.parent / "recipes" / "demo.yaml"
SETTINGS = ["mode=fully_async", "warmup.steps=0", "rollout.num_workers=2", "rollout.prompts_per_step=4",
            "rollout.n_samples=4", "rollout.batch_prompts=4", "trainer.checkpoint_every=2",
            "trainer.async_checkpoint=false", "store.retention=keep", "store.keep_plans=1000000000",
            "store.wait_timeout_s=120", "launch.time_min=20", "launch.signal_delay_s=30", "launch.max_requeues=40",
            "launch.trainer.cpus_per_task=1", "launch.trainer.max_restarts=40", "launch.rollout.max_restarts=40",
            "launch.trainer.restart_backoff_s=0.2", "launch.rollout.restart_backoff_s=0.2",
            "launch.trainer.restart_backoff_max_s=2", "launch.rollout.restart_backoff_max_s=2",
            "weights.keep_last=2", "weights.transport={kind: files}"]
"""The demo made tiny (4 prompts x 4 samples a step, checkpoint every 2 steps), keeping every shard and plan for
the audit; restarts soon and often. The weights go through the snapshot files only: re-forming the fast path's
process group after each kill costs seconds of this tier's budget (the fast path's own recovery is tested in
tests/unit/test_fastpath.py)."""
_MODE = roles.MODES["fully_async"]
TRAINER_PROC = proc_name(_MODE.main.name, 0)
ROLE_PROCS = (TRAINER_PROC, *(proc_name(r.name, k) for r in _MODE.roles if r is not _MODE.main for k in range(2)))
"""The processes a run of :data:`SETTINGS` has (one trainer, two rollout workers), from the role table."""
MAX_RESUMES = 6
FOLLOW_S = 3.0


@dataclass
class ChaosRun:
    """One run under chaos: its run dir, what was done to it, and when the next action is due."""

    index: int
    rd: RunDir
    placement: str
    kills_left: int
    trainer_ranks: int = 1
    """Ranks of its trainer (one process group of that many ranks, restarted as a whole when one is killed)."""
    next_at: float = 0.0
    kills: dict[str, int] = field(default_factory=dict)
    requeues: int = 0
    step_cancels: int = 0
    resumes: int = 0
    jobs: set[str] = field(default_factory=set)
    step_at_action: int = -1
    """The trainer's step when the last blow to it landed: the next one waits until the trainer got past it."""
    last_killed: str = ""
    next_follow: float = 0.0
    """When its jobs are asked about next (squeue is a process and a controller RPC: every FOLLOW_S, not every poll)."""
    done: bool = False
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    notes: list[str] = field(default_factory=list)

    def job_ids(self) -> list[str]:
        rec = read_json(self.rd.launch_record, default={}, expect=dict) or {}
        ids = [str(e["job_id"]) for e in rec.get("jobs", [])]
        self.jobs.update(ids)
        return ids


# ------------------------------------------------------------------------------------------------ submitting
def submit(index: int, base: Path, steps: int, placement: str, kills: int, seed: int,
           trainer_ranks: int = 1, extra: tuple[str, ...] = ()) -> ChaosRun:
    """Create the run dir and submit the run's jobs (in this process: no CLI start-up per run)."""
    from relax_hpc.cli.submit import prepare_run_dir
    from relax_hpc.launch.slurm import launch

    overrides = [*SETTINGS, f"num_steps={steps}", f"launch.placement={placement}", f"seed={seed + index}",
                 f"name=chaos{index:02d}", f"trainer.num_ranks={trainer_ranks}", *extra]
    args = argparse.Namespace(recipe=str(DEMO), overrides=overrides, run_dir=str(base / f"run{index:02d}"))
    rd, cfg = prepare_run_dir(args)
    launch(rd, cfg)
    run = ChaosRun(index, rd, placement, kills, trainer_ranks)
    run.job_ids()
    return run


# ------------------------------------------------------------------------------------------------ the actions
def live_role_pid(rd: RunDir, proc: str) -> int | None:
    """The pid of ``proc`` when its heartbeat names a live ``relax_hpc role`` process of this machine."""
    try:
        hb = read_json(rd.heartbeat(proc), default=None, expect=dict)
    except (OSError, ValueError):
        return None
    if not hb or hb.get("state") in ("stopped", "failed") or hb.get("host") != os.uname().nodename:
        return None
    pid = hb.get("pid")
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, TypeError):
        return None
    if b"relax_hpc" not in cmd or b"role" not in cmd or b"--supervise" in cmd:
        return None
    return int(pid)


def worked(rd: RunDir, proc: str) -> bool:
    """Has this incarnation of a rollout worker finished a batch (the step of its heartbeat counts its prompts)?"""
    try:
        hb = read_json(rd.heartbeat(proc), default=None, expect=dict) or {}
    except (OSError, ValueError):
        return False
    return isinstance(hb.get("step"), int) and hb["step"] > 0


def kill_one(run: ChaosRun, rng: random.Random, *, trainer: bool) -> bool:
    """SIGKILL one live role process of ``run``, a random one of those that did some work since they started: the
    trainer only if ``trainer`` (it trained past the last blow), a rollout worker once it finished a batch. False
    when none is up right now."""
    ranks = [proc_name(_MODE.main.name, k) for k in range(1, run.trainer_ranks)]
    procs = [p for p in (*ROLE_PROCS, *ranks) if (trainer if p in (TRAINER_PROC, *ranks) else worked(run.rd, p))
             and live_role_pid(run.rd, p) is not None]
    if not procs:
        return False
    proc = rng.choice(procs)
    pid = live_role_pid(run.rd, proc)
    if pid is None:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    run.kills[proc] = run.kills.get(proc, 0) + 1
    run.last_killed = proc
    run.kills_left -= 1
    return True


def running_steps(job_ids: list[str]) -> list[str]:
    """Ids of the running job steps (``123.0``, ``124_1.0``, ``125+1.0``) of these jobs (not the batch step)."""
    if not job_ids:
        return []
    res = slurm_cli.run_slurm(["squeue", "-h", "-s", "-j", ",".join(job_ids), "-o", "%i"])
    if res.returncode != 0:
        raise UserError(f"squeue -s failed: {res.stderr.strip()[:200]}")
    return [s for s in res.stdout.split() if not s.endswith((".batch", ".extern"))]


def requeue_one(run: ChaosRun, rng: random.Random) -> bool:
    """``scontrol requeue`` one running job (or array task) of ``run``."""
    q = slurm_cli.query_jobs(run.job_ids(), use_sacct=False)
    running = sorted({r.job_id.split("+")[0] for j in run.job_ids() for r in q.of(j) if r.state == "RUNNING"})
    if not running:
        return False
    try:
        slurm_cli.requeue(rng.choice(running))
    except UserError as exc:
        run.notes.append(f"requeue refused: {exc}")
        return False
    run.requeues += 1
    return True


def cancel_step(run: ChaosRun, rng: random.Random) -> bool:
    """``scancel`` one running job step of ``run`` (of its plain jobs and array tasks: the steps of a het job are
    not addressable as ``JOB.STEP`` in Slurm 22.05, scancel answers "Invalid job id specified")."""
    rec = read_json(run.rd.launch_record, default={}, expect=dict) or {}
    steps = running_steps([str(e["job_id"]) for e in rec.get("jobs", []) if e.get("kind") != "hetjob"])
    if not steps:
        return False
    step = rng.choice(steps)
    res = slurm_cli.run_slurm(["scancel", step])
    if res.returncode != 0:
        run.notes.append(f"scancel {step} refused: {res.stderr.strip()[:200]}")
        return False
    run.step_cancels += 1
    return True


def act(run: ChaosRun, rng: random.Random, now: float, gap: tuple[float, float], p_slurm: float) -> None:
    """The next chaos action of ``run`` when due, while kills are left and its trainer is up. What hits the trainer
    (its kill, a requeue, a step cancel) waits until it trained past the step of the last such blow, so that every
    run makes progress; rollout workers are killed at any time."""
    if now < run.next_at or run.kills_left <= 0 or live_role_pid(run.rd, TRAINER_PROC) is None:
        return
    step = trainer_step(run.rd)
    progressed = step > run.step_at_action
    x = rng.random()
    if x < p_slurm and progressed:
        ok = requeue_one(run, rng) if x < p_slurm / 2 else cancel_step(run, rng)
        hit_trainer = ok
    else:
        ok = kill_one(run, rng, trainer=progressed)
        hit_trainer = ok and run.last_killed.startswith(f"{_MODE.main.name}-")
    if ok:
        run.next_at = now + rng.uniform(*gap)
    if hit_trainer:
        run.step_at_action = step


def trainer_step(rd: RunDir) -> int:
    """The step of the running trainer's heartbeat (-1: none, or not running yet)."""
    try:
        hb = read_json(rd.heartbeat(TRAINER_PROC), default=None, expect=dict) or {}
    except (OSError, ValueError):
        return -1
    step = hb.get("step")
    return int(step) if isinstance(step, int) and hb.get("state") == "running" else -1


# ------------------------------------------------------------------------------------------------ following
def completed(rd: RunDir) -> bool:
    try:
        final = read_json(rd.status_file, default=None, expect=dict)
    except (OSError, ValueError):
        return False
    return isinstance(final, dict) and final.get("state") == "completed"


def trainer_jobs(rd: RunDir) -> list[str]:
    """Ids of the run's jobs that run its trainer-side role."""
    from relax_hpc.roles.spec import is_trainer_side

    rec = read_json(rd.launch_record, default={}, expect=dict) or {}
    return [str(e["job_id"]) for e in rec.get("jobs", []) if any(is_trainer_side(n) for n in e.get("roles", []))]


def follow(run: ChaosRun) -> None:
    """Mark ``run`` done once it completed and its jobs left the queue; resume it when they ended otherwise."""
    from relax_hpc.launch.resume import resume_run

    now = time.monotonic()
    if now < run.next_follow:
        return
    run.next_follow = now + FOLLOW_S
    ids = run.job_ids()
    q = slurm_cli.query_jobs(ids, use_sacct=False)
    active = [j for j in ids if any(r.active for r in q.of(j))]
    if active and not completed(run.rd) and not set(active) & set(trainer_jobs(run.rd)):
        slurm_cli.scancel(active)  # the trainer's job ended without completing: its rollout jobs wait in vain
        return
    if active:
        return
    if completed(run.rd) or run.resumes >= MAX_RESUMES:
        run.done, run.ended = True, time.monotonic()
        return
    run.resumes += 1
    try:
        resume_run(run.rd)
    except UserError as exc:
        run.notes.append(f"resume {run.resumes}: {exc}")
    run.job_ids()


# ------------------------------------------------------------------------------------------------ accounting
def account(runs: list[ChaosRun], steps: int, groups_per_step: int) -> dict[str, Any]:
    """Totals over every run: the store audits, the trained groups, restarts."""
    from relax_hpc.launch.runctl import read_restarts
    from relax_hpc.store.audit import audit

    keys = ("produced", "consumed", "dropped", "quarantined", "unread", "duplicated", "lost")
    samples = dict.fromkeys(keys, 0)
    problems: list[str] = []
    restarts = 0
    for run in runs:
        a = audit(run.rd)
        for k in keys:
            samples[k] += getattr(a, k)
        problems += [f"run {run.index}: {p}" for p in a.problems]
        trained = a.consumed_groups - a.duplicated_groups
        if completed(run.rd) and trained != steps * groups_per_step:
            problems.append(f"run {run.index}: {trained} groups in the committed plans, not {steps} x "
                            f"{groups_per_step}")
        if not a.balanced and not a.problems:
            problems.append(f"run {run.index}: the store's accounting does not add up: {a.to_json()}")
        restarts += sum(r.get("restarts", 0) for r in read_restarts(run.rd).values())
    return {"samples": samples, "problems": problems, "restarts": restarts}


def summary(runs: list[ChaosRun], acc: dict[str, Any], wall_s: float, args: argparse.Namespace) -> dict[str, Any]:
    kills: dict[str, int] = {}
    for run in runs:
        for proc, n in run.kills.items():
            kills[proc] = kills.get(proc, 0) + n
    return {
        "runs": len(runs), "kills": sum(kills.values()), "kills_by_proc": kills,
        "requeues": sum(r.requeues for r in runs), "step_cancels": sum(r.step_cancels for r in runs),
        "resumes": sum(r.resumes for r in runs), "completed": sum(completed(r.rd) for r in runs),
        "restarts": acc["restarts"], **acc["samples"], "problems": acc["problems"],
        "notes": [f"run {r.index}: {n}" for r in runs for n in r.notes][:20],
        "run_seconds_median": sorted((r.ended or time.monotonic()) - r.started for r in runs)[len(runs) // 2],
        "wall_s": round(wall_s, 1), "parallel": args.parallel, "steps": args.steps,
        "trainer_ranks": args.trainer_ranks,
        "machine": f"{os.uname().nodename}, {os.cpu_count()} CPUs",
    }


# ------------------------------------------------------------------------------------------------ main
def kill_quota(runs: list[ChaosRun], args: argparse.Namespace) -> int:
    """Kills for the next run: what is still missing of ``--kills`` (runs that completed before their quota was
    spent leave more for the later ones), spread over the runs not yet started."""
    planned = sum(sum(r.kills.values()) + (0 if r.done else r.kills_left) for r in runs)
    return math.ceil(max(0, args.kills - planned) / max(1, args.runs - len(runs)))


def another_run(runs: list[ChaosRun], args: argparse.Namespace) -> bool:
    """Whether to submit another run: fewer than ``--runs`` so far, or the kills landed and still planned fall short
    of ``--kills`` (runs that completed before their quota was spent), up to ``--runs // 2`` runs more."""
    if len(runs) < args.runs:
        return True
    return len(runs) < args.runs + max(1, args.runs // 2) and kill_quota(runs, args) > 0


def chaos(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole tier; returns the summary (see :func:`summary`)."""
    from relax_hpc.bench.slurm import use_local_cluster

    use_local_cluster()
    problem = slurm_cli.slurm_problem(timeout_s=10)
    if problem:
        raise UserError(f"bench chaos needs a Slurm cluster ({problem}); start one with tools/slurm_local.sh start")
    rng = random.Random(args.seed)
    base = Path(args.base or tempfile.mkdtemp(prefix="relax-chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    runs: list[ChaosRun] = []
    t0 = time.monotonic()
    deadline = t0 + args.timeout_s
    try:
        while time.monotonic() < deadline:
            live = [r for r in runs if not r.done]
            if len(live) < args.parallel and another_run(runs, args):
                placement = ("hetjob", "separate")[len(runs) % 2]
                runs.append(submit(len(runs), base, args.steps, placement, kill_quota(runs, args), args.seed,
                                   args.trainer_ranks, tuple(args.overrides)))
                continue
            if not live:
                break
            now = time.monotonic()
            for run in live:
                act(run, rng, now, (args.min_gap_s, args.max_gap_s), args.p_slurm)
                follow(run)
            time.sleep(0.2)
    finally:
        slurm_cli.scancel(sorted({j for r in runs for j in r.jobs}))
    acc = account(runs, args.steps, 4)
    out = summary(runs, acc, time.monotonic() - t0, args)
    out["base"] = str(base)
    if time.monotonic() >= deadline:
        out["problems"].append(f"stopped after --timeout-s {args.timeout_s:g}: runs still going were cancelled")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="relax-hpc bench chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--runs", type=int, default=20, help="fully_async runs (default 20; up to a quarter more while "
                   "kills of --kills are missing: runs that completed before their quota was spent)")
    p.add_argument("--kills", type=int, default=100, help="SIGKILLs in all (spread evenly over the runs)")
    p.add_argument("--parallel", type=int, default=5, help="runs at once (default 5: 3 tasks each fill the local "
                   "cluster's 4 nodes of 4 CPUs)")
    p.add_argument("--steps", type=int, default=16, help="trainer steps per run (default 16)")
    p.add_argument("--p-slurm", type=float, default=0.2,
                   help="fraction of the actions that are a requeue or a step cancel instead of a kill")
    p.add_argument("--min-gap-s", type=float, default=0.5, help="shortest time between two actions on a run")
    p.add_argument("--max-gap-s", type=float, default=2.5, help="longest time between two actions on a run")
    p.add_argument("--trainer-ranks", type=int, default=1,
                   help="ranks of each run's trainer (>1: one gloo process group, restarted as a whole by the role "
                   "supervisors when any rank is killed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a recipe override for every run, after the tier's own (repeatable), e.g. delta snapshots: "
                        "--set 'weights.delta={every_full: 4, max_fraction: 1.0}' --set model.dtype=bfloat16")
    p.add_argument("--base", default=None, help="folder for the run dirs (default: a new temporary one)")
    p.add_argument("--timeout-s", type=float, default=1500.0, help="give up (and cancel everything) after this")
    args = p.parse_args(argv)
    if args.runs < 1 or args.kills < 0 or args.parallel < 1 or args.steps < 1 or args.trainer_ranks < 1:
        raise UserError("--runs, --parallel, --steps and --trainer-ranks must be >= 1 and --kills >= 0")
    if args.overrides:  # a bad --set is one error line before anything is submitted
        from relax_hpc.config.load import load_recipe

        load_recipe(str(DEMO), [*SETTINGS, *args.overrides])
    out = chaos(args)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"runs {out['runs']}  kills {out['kills']}  requeues {out['requeues']}  step cancels "
              f"{out['step_cancels']}  resumes {out['resumes']}  completed {out['completed']}  restarts "
              f"{out['restarts']}  ({out['wall_s']:.0f} s)")
        print("samples: " + "  ".join(f"{k} {out[k]}" for k in ("produced", "consumed", "dropped", "quarantined",
                                                                 "unread", "duplicated", "lost")))
        for problem in out["problems"]:
            print(f"problem: {problem}")
    ok = out["lost"] == 0 and out["duplicated"] == 0 and out["completed"] == out["runs"] and not out["problems"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
