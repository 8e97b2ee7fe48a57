"""The ``launch`` section: where and how the roles run (executor, Slurm resources, restarts)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from relax_hpc.config.base import Section


class RoleResources(Section):
    """Slurm resources of one role and how its dead processes are restarted (the local executor uses ``env``,
    ``cpu_affinity``, ``gpus`` and the restart fields only)."""

    nodes: int = Field(1, ge=1)
    """Nodes for this role."""
    tasks_per_node: int = Field(1, ge=1)
    """Tasks (processes) per node."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs per node."""
    cpus_per_task: int = Field(1, ge=1)
    """CPUs per task."""
    mem_gb: float | None = Field(None, gt=0)
    """Memory per node in GB (None = the partition's default)."""
    partition: str | None = None
    """Slurm partition (None = launch.partition)."""
    constraint: str | None = None
    """Slurm --constraint."""
    extra_sbatch: list[str] = Field(default_factory=list)
    """Extra ``#SBATCH`` lines, e.g. ``--reservation=rl``."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for this role."""
    cpu_affinity: list[int] | None = None
    """Local executor only: pin every process of this role to these CPU ids (``os.sched_setaffinity``), e.g. ``[0]``
    for the trainer and ``[1]`` for the rollout worker on a 2-core machine. None = no pinning. Slurm ignores it (use
    ``--cpu-bind`` through ``slurm`` or ``extra_sbatch`` there)."""
    gpus: list[int] | None = None
    """Local executor only: the GPU ids of this role's processes, rank ``r`` on ``gpus[r % len(gpus)]``. Its
    ``CUDA_VISIBLE_DEVICES`` lists that GPU first (so its ``cuda`` device is that GPU), then every other GPU up to
    the highest id either role names (so NCCL still sees them for peer-to-peer copies), e.g. ``[0]`` for the trainer
    and ``[1]`` for the rollout worker on a 2-GPU machine. None = the environment's ``CUDA_VISIBLE_DEVICES`` (a
    trainer of several ranks takes GPU ``rank % count``). Slurm ignores it (it assigns GPUs by ``gpus_per_node``)."""
    max_restarts: int = Field(5, ge=0)
    """How often the role supervisor restarts a dead process of this role (killed by a signal or silent for
    ``monitor.dead_after_s``; a rollout worker also after it failed), per rank and launcher (or Slurm job)
    incarnation; 0: never. A restarted trainer resumes from its newest complete checkpoint, a restarted rollout
    worker rejoins at the latest snapshot. Roles whose ranks form a process group (a trainer of several ranks)
    restart as a whole: the death of any rank stops the others by pid and starts every rank again (each rank's
    restart counts here). Ranks started by ``launcher: torchrun`` are not supervised."""
    restart_backoff_s: float = Field(1.0, ge=0, le=3600)
    """Seconds before the first restart of a rank; each further restart of the same rank waits twice as long."""
    restart_backoff_max_s: float = Field(60.0, ge=0, le=86400)
    """The longest wait before a restart."""
    slurm: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """More Slurm parameters by name (``exclude``, ``gres``, ``nodelist``, ``exclusive``, ``mail_type`` ...; the
    names of submitit's Slurm executor). An unknown name is an error listing the valid ones."""
    launcher: Literal["srun", "torchrun"] = "srun"
    """Slurm: how the role's ranks start. ``srun``: one Slurm task per rank (``nodes x tasks_per_node`` tasks, the
    rank from ``SLURM_PROCID``). ``torchrun`` (the trainer role only): one Slurm task per node running
    ``torchrun --nnodes=nodes --nproc-per-node=tasks_per_node`` with a c10d rendezvous on the first node; ranks and
    the process group come from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``); ``nodes x
    tasks_per_node`` must equal ``trainer.num_ranks``, and each node gets ``tasks_per_node x cpus_per_task`` CPUs."""
    torchrun_port: int = Field(29500, ge=1024, le=65535)
    """``launcher: torchrun``: the TCP port of the c10d rendezvous on the role's first node."""

    @field_validator("cpu_affinity")
    @classmethod
    def _cpu_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(c < 0 for c in v)):
            raise ValueError("cpu_affinity must be a non-empty list of CPU ids >= 0 (or null for no pinning)")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpu_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(g < 0 for g in v)):
            raise ValueError("gpus must be a non-empty list of GPU ids >= 0 (or null: the environment's GPUs)")
        return v


class LaunchConfig(Section):
    """Where and how the roles run."""

    executor: Literal["auto", "local", "slurm"] = "auto"
    """``auto``: Slurm when ``sbatch`` is on PATH, else local processes."""
    placement: Literal["hetjob", "separate"] = "hetjob"
    """fully_async on Slurm: one heterogeneous job (trainer and rollout het groups) or separate jobs."""
    partition: str | None = None
    """Default partition."""
    account: str | None = None
    """Slurm account."""
    qos: str | None = None
    """Slurm QOS."""
    time_min: int = Field(240, ge=1)
    """Time limit in minutes."""
    signal_delay_s: int = Field(120, ge=10)
    """Seconds before the time limit at which Slurm sends the preemption signal (USR2)."""
    max_requeues: int = Field(10, ge=0)
    """How often a preempted or timed-out trainer requeues itself."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run before each role (module load, conda activate ...)."""
    trainer: RoleResources = Field(default_factory=RoleResources)
    """Trainer resources."""
    rollout: RoleResources = Field(default_factory=RoleResources)
    """Rollout resources (one task per rollout worker)."""

    @model_validator(mode="after")
    def _torchrun_is_for_the_trainer(self) -> LaunchConfig:
        if self.rollout.launcher != "srun":
            raise ValueError("launch.rollout.launcher: torchrun starts trainer ranks only; rollout workers are one "
                             "Slurm task each (launcher: srun)")
        return self
