"""Roles as data: the one table from mode to the roles it runs.

A *role* is one kind of process of a run (its processes are ``<role>-<rank>``, started as ``relax-hpc role <role>``);
a *mode* is the set of roles a run starts. The launchers (local and Slurm), the sbatch renderer, role dispatch,
sweeps, resume, scale and status all read this table instead of switching on mode or role names. A new role is one
:class:`RoleSpec` here (and in a mode's ``roles``) plus the module of its loop, imported only when the role runs.

This module is a low layer: it imports nothing heavy and nothing from ``modes/``, ``launch/`` or ``cli/``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Literal

from relax_hpc.errors import UserError
from relax_hpc.rundir import proc_name

if TYPE_CHECKING:
    from relax_hpc.config.schema import RecipeConfig, RoleResources

Restart = Literal["killed", "failed"]
"""When the role supervisor (:mod:`relax_hpc.launch.supervisor`) restarts a dead process of a role: ``killed``:
only when a signal ended it or its heartbeat went silent (a role that raised would fail the same way again);
``failed``: also after any failing exit status (a stateless role). Exit 0 (done), 2 (bad input) and 3
(checkpointed after SIGTERM/SIGUSR2: whoever sent it decides what follows) are never restarted."""

Requeue = Literal["resume", "rejoin"]
"""What a requeued (preempted, timed-out) role does when it starts again: ``resume`` from its latest checkpoint, or
``rejoin`` the run at the latest weight snapshot (it keeps no state of its own)."""


@dataclass(frozen=True)
class RoleSpec:
    """One role: what it runs, how many ranks, which resources, and how Slurm and the launchers treat it."""

    name: str
    """Its processes are ``<name>-<rank>`` (logs, events, heartbeats); the role entry is ``relax-hpc role <name>``."""
    loop: str
    """``module:function`` of its loop, imported only when the role runs. Called as ``fn(run_dir, cfg, rank=R)``,
    plus ``world_size=N`` for a role whose ranks form a ``group``; returns the process exit code."""
    ranks: str
    """Dotted config field holding the number of its ranks (``trainer.num_ranks``)."""
    resources: Literal["trainer", "rollout"]
    """The section of ``launch`` with its Slurm resources, environment, threads and CPU pinning."""
    trainer_side: bool
    """Its processes decide how the run ends: one failing stops the run; all of them done means the run is done
    (the other roles are then stopped). Its rank 0 logs the run's step metrics."""
    requeue: Requeue
    """What it does when started again after a preemption or the time limit (it exits 3 to ask for a requeue)."""
    elastic: bool
    """Ranks can be added and drained while the run goes on (``relax-hpc scale``); with placement ``separate`` it is
    a job array, one task per rank (the task id is the rank)."""
    group: str | None
    """Name of the torch.distributed group its ranks form through the run dir before the loop starts (None: none)."""
    generates: bool
    """It generates samples (used by the time-limit estimate)."""
    trains: bool
    """It trains the policy (used by the time-limit estimate)."""
    noun: str
    """What one of its processes is called in messages and scripts (``rollout worker``)."""
    summary: str
    """What its processes do, for the title of its own sbatch job (``every rank generates and trains``)."""
    sbatch_note: str
    """Comment above the job step in its own sbatch script (lines separated by newlines)."""
    restart: Restart = "killed"
    """When the role supervisor restarts a dead process of this role (:data:`Restart`); how often and how soon:
    ``max_restarts`` and ``restart_backoff_s`` of its ``launch`` section. A restarted process does what
    :attr:`requeue` says (resume from the newest complete checkpoint, or rejoin at the latest snapshot)."""
    time_limit: str = "launch.time_min"
    """Dotted config field holding its Slurm time limit in minutes."""

    @property
    def checkpoints(self) -> bool:
        """It writes checkpoints (and resumes from them when requeued)."""
        return self.requeue == "resume"

    def load_loop(self) -> Callable[..., int]:
        """Import and return its loop function."""
        module, _, fn = self.loop.partition(":")
        return getattr(importlib.import_module(module), fn)


@dataclass(frozen=True)
class ModeSpec:
    """One mode: the roles a run of this mode starts, in launch order (the trainer-side role first)."""

    name: str
    roles: tuple[RoleSpec, ...]
    sweepable: bool
    """A sweep can run each of its combinations as one array task (a mode of a single role, one job)."""

    @property
    def main(self) -> RoleSpec:
        """The trainer-side role (exactly one per mode)."""
        (spec,) = [r for r in self.roles if r.trainer_side]
        return spec

    @property
    def elastic(self) -> RoleSpec | None:
        """The role whose ranks can be added and drained (at most one per mode), or None."""
        found = [r for r in self.roles if r.elastic]
        assert len(found) <= 1, f"mode {self.name}: at most one elastic role"
        return found[0] if found else None

    @property
    def single_job(self) -> bool:
        """One role: the whole run is one job (``launch.placement`` does not apply)."""
        return len(self.roles) == 1

    @property
    def overlapped(self) -> bool:
        """Generation and training run in different roles at the same time (else one role does one, then the other)."""
        return not any(r.generates and r.trains for r in self.roles)


TRAINER = RoleSpec(
    name="trainer", loop="relax_hpc.modes.async_trainer:run_async_trainer", ranks="trainer.num_ranks",
    resources="trainer", trainer_side=True, requeue="resume", elastic=False, group="trainer", generates=False,
    trains=True, noun="trainer", summary="the trainer job",
    sbatch_note="The rollout workers run as separate jobs, linked to this one only through the run dir.")
ROLLOUT = RoleSpec(
    name="rollout", loop="relax_hpc.modes.async_rollout:run_rollout_worker", ranks="rollout.num_workers",
    resources="rollout", trainer_side=False, requeue="rejoin", elastic=True, group=None, generates=True,
    trains=False, restart="failed", noun="rollout worker", summary="rollout workers",
    sbatch_note="One array task per rollout worker; the task id is the worker's rank. Workers are stateless: a "
                "requeued one\nrejoins at the latest weight snapshot.")
COLOCATE = RoleSpec(
    name="colocate", loop="relax_hpc.modes.colocate:run_colocate", ranks="trainer.num_ranks", resources="trainer",
    trainer_side=True, requeue="resume", elastic=False, group="trainer", generates=True, trains=True,
    noun="colocate rank", summary="one job, every rank generates and trains",
    sbatch_note="Every rank generates and trains (mode colocate).")

ROLES: dict[str, RoleSpec] = {r.name: r for r in (TRAINER, ROLLOUT, COLOCATE)}
"""Every role, by name."""

MODES: dict[str, ModeSpec] = {
    "colocate": ModeSpec("colocate", (COLOCATE,), sweepable=True),
    "fully_async": ModeSpec("fully_async", (TRAINER, ROLLOUT), sweepable=False),
}
"""Every mode (the values of ``RecipeConfig.mode``), by name."""


# ------------------------------------------------------------------------------------------------ lookups
def role_spec(name: str) -> RoleSpec:
    """The role called ``name`` (a :class:`UserError` naming the valid ones when there is none)."""
    try:
        return ROLES[name]
    except KeyError:
        raise UserError(f"unknown role {name!r} (roles: {', '.join(ROLES)})") from None


def mode_spec(mode: str | RecipeConfig) -> ModeSpec:
    """The mode called ``mode``, or the mode of a config."""
    name = mode if isinstance(mode, str) else mode.mode
    try:
        return MODES[name]
    except KeyError:
        raise UserError(f"unknown mode {name!r} (modes: {', '.join(MODES)})") from None


def role_names() -> tuple[str, ...]:
    """Every role's name (the choices of ``relax-hpc role``)."""
    return tuple(ROLES)


def trainer_side_names() -> tuple[str, ...]:
    """The trainer-side roles of every mode: where a run dir's step metrics are (``trainer``, ``colocate``)."""
    return tuple(r.name for r in ROLES.values() if r.trainer_side)


def is_trainer_side(name: str | None) -> bool:
    spec = ROLES.get(name or "")
    return spec is not None and spec.trainer_side


def is_elastic(name: str | None) -> bool:
    """Is ``name`` a role whose ranks can be added and drained? (False for names that are no role.)"""
    spec = ROLES.get(name or "")
    return spec is not None and spec.elastic


# ------------------------------------------------------------------------------------------------ per config
def num_ranks(cfg: RecipeConfig, role: RoleSpec) -> int:
    """How many ranks ``role`` has in the run of ``cfg``."""
    return int(attrgetter(role.ranks)(cfg))


def resources(cfg: RecipeConfig, role: RoleSpec | str) -> RoleResources:
    """The ``launch`` section with ``role``'s resources."""
    spec = role if isinstance(role, RoleSpec) else role_spec(role)
    return getattr(cfg.launch, spec.resources)


def resources_where(role: RoleSpec) -> str:
    """The config path of ``role``'s resources, for messages (``launch.trainer``)."""
    return f"launch.{role.resources}"


def time_limit_min(cfg: RecipeConfig, role: RoleSpec) -> int:
    """``role``'s Slurm time limit in minutes."""
    return int(attrgetter(role.time_limit)(cfg))


def role_plan(cfg: RecipeConfig) -> list[tuple[str, int]]:
    """(role, rank) of every process the run of ``cfg`` needs, in launch order."""
    return [(r.name, rank) for r in mode_spec(cfg).roles for rank in range(num_ranks(cfg, r))]


def main_proc(cfg: RecipeConfig) -> str:
    """The process that logs the run's step metrics (``colocate-0``, ``trainer-0``)."""
    return proc_name(mode_spec(cfg).main.name, 0)


def placement(cfg: RecipeConfig) -> str | None:
    """``launch.placement`` when the mode has several roles, None when the whole run is one job."""
    return None if mode_spec(cfg).single_job else cfg.launch.placement


def elastic_ranks(entries: Iterable[dict[str, Any]]) -> set[int]:
    """Ranks of the elastic role in launch-record job entries (``{"roles": [...], "ranks": [...]}``)."""
    return {int(r) for e in entries if any(is_elastic(n) for n in e.get("roles") or [e.get("role")])
            for r in e.get("ranks", [])}


ROLLOUT_GRACE_S = 60
"""How long the rollout workers have to end by themselves after the trainer finished (the final evaluation's
time comes on top: :func:`rollout_grace_s`)."""


def rollout_grace_s(cfg: RecipeConfig, role: str | None = None, rank: int | None = None) -> float:
    """How long a launcher waits for a helper process (``role`` ``rank``; None: the rollout workers as one Slurm
    step) to end by itself once the trainer has finished: the workers see the run complete and exit, the evaluating
    one (rollout worker ``eval.worker``) after evaluating the final weights (``eval.end_timeout_s`` more)."""
    ev = cfg.eval
    if ev is None or not ev.at_end:
        return ROLLOUT_GRACE_S
    if role is not None:
        spec = role_spec(role)
        if not spec.generates or spec.trainer_side or rank != ev.worker:
            return ROLLOUT_GRACE_S
    return ROLLOUT_GRACE_S + ev.end_timeout_s
