"""The run directory: the single owner of every path in a relax-hpc run.

Nothing else in the code base joins run-dir paths by hand; ask a :class:`RunDir` instead. The on-disk protocol
(who writes what, atomicity, retention) is documented in ``docs/protocol.md``.

Layout::

    RUN_DIR/
      RUN.json                      identity of the run (written once, at creation) -- marks a folder as a run dir
      recipe.yaml                   the recipe as the user gave it
      config.json                   the resolved, validated config (all roles)
      config/<role>.json            the resolved config as each role saw it at start
      samples/shards/<writer>/      published HDF5 shards, one folder per writer incarnation
      samples/tmp/                  writers' temporary files (same filesystem, for atomic renames)
      samples/quarantine/           corrupt shards, moved aside with a reason file
      samples/consumers/<name>/     a consumer group's committed read position and per-step batch plans
      weights/vNNNNNN/              published weight snapshots (safetensors + manifest.json + COMPLETE)
      weights/LATEST                the newest complete snapshot's version (one small read)
      weights/leases/               readers' leases on snapshots they are loading
      weights/pins/                 pinned versions, never deleted by retention
      checkpoints/step_NNNNNNNN/    trainer checkpoints (COMPLETE marker); checkpoints/LATEST
      logs/events/<proc>.jsonl      each process's event and metric lines (single writer)
      logs/<proc>.log               each process's text log
      heartbeats/<proc>.json        each process's heartbeat, rewritten atomically
      rendezvous/<group>.json       address of a torch.distributed store for the fast path
      control/                      requests to roles (drain, stop) written by the CLI
      slurm/                        sbatch scripts, submitit folders, jobs.json
      export/                       the final model in HF format
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relax_hpc import __version__
from relax_hpc.errors import RunDirError
from relax_hpc.fsio import atomic_write_json, read_json

RUN_MARKER = "RUN.json"


def proc_name(role: str, rank: int) -> str:
    """The name of one process of a role, used for its log, event and heartbeat files: ``trainer-0``."""
    if not role.replace("_", "").isalnum():
        raise ValueError(f"role must be alphanumeric (underscores allowed), got {role!r}")
    return f"{role}-{rank}"


@dataclass(frozen=True)
class RunDir:
    """Paths of one run directory. Cheap to construct; touches the filesystem only in methods that say so."""

    root: Path

    def __init__(self, root: Path | str):
        object.__setattr__(self, "root", Path(root).expanduser().absolute())

    # ---------------------------------------------------------------- top level
    @property
    def marker(self) -> Path:
        return self.root / RUN_MARKER

    @property
    def recipe(self) -> Path:
        return self.root / "recipe.yaml"

    @property
    def config(self) -> Path:
        return self.root / "config.json"

    def role_config(self, role: str) -> Path:
        return self.root / "config" / f"{role}.json"

    # ---------------------------------------------------------------- samples
    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def shards(self) -> Path:
        return self.samples / "shards"

    def writer_shards(self, writer_id: str) -> Path:
        return self.shards / writer_id

    @property
    def samples_tmp(self) -> Path:
        return self.samples / "tmp"

    @property
    def quarantine(self) -> Path:
        return self.samples / "quarantine"

    def consumer(self, name: str = "trainer") -> Path:
        return self.samples / "consumers" / name

    def consumer_position(self, name: str = "trainer") -> Path:
        return self.consumer(name) / "position.json"

    def consumer_plans(self, name: str = "trainer") -> Path:
        return self.consumer(name) / "plans"

    def consumer_plan(self, step: int, name: str = "trainer") -> Path:
        return self.consumer_plans(name) / f"step_{step:08d}.json"

    # ---------------------------------------------------------------- weights
    @property
    def weights(self) -> Path:
        return self.root / "weights"

    def snapshot(self, version: int) -> Path:
        return self.weights / f"v{version:06d}"

    @property
    def weights_latest(self) -> Path:
        return self.weights / "LATEST"

    @property
    def weight_leases(self) -> Path:
        return self.weights / "leases"

    @property
    def weight_pins(self) -> Path:
        return self.weights / "pins"

    # ---------------------------------------------------------------- checkpoints
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:08d}"

    @property
    def checkpoints_latest(self) -> Path:
        return self.checkpoints / "LATEST"

    # ---------------------------------------------------------------- logs, heartbeats, rendezvous, control
    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def events(self) -> Path:
        return self.logs / "events"

    def event_log(self, proc: str) -> Path:
        return self.events / f"{proc}.jsonl"

    def text_log(self, proc: str) -> Path:
        return self.logs / f"{proc}.log"

    @property
    def heartbeats(self) -> Path:
        return self.root / "heartbeats"

    def heartbeat(self, proc: str) -> Path:
        return self.heartbeats / f"{proc}.json"

    @property
    def rendezvous(self) -> Path:
        return self.root / "rendezvous"

    def rendezvous_file(self, group: str) -> Path:
        return self.rendezvous / f"{group}.json"

    @property
    def control(self) -> Path:
        return self.root / "control"

    def control_file(self, proc: str) -> Path:
        return self.control / f"{proc}.json"

    @property
    def slurm(self) -> Path:
        return self.root / "slurm"

    @property
    def slurm_jobs(self) -> Path:
        return self.slurm / "jobs.json"

    @property
    def export(self) -> Path:
        return self.root / "export"

    # ---------------------------------------------------------------- lifecycle
    _FOLDERS = ("samples/shards", "samples/tmp", "samples/quarantine", "samples/consumers", "weights/leases",
                "weights/pins", "checkpoints", "logs/events", "heartbeats", "rendezvous", "control", "slurm",
                "config")

    def is_run_dir(self) -> bool:
        return self.marker.is_file()

    def info(self) -> dict[str, Any]:
        """The content of ``RUN.json``. Raises :class:`RunDirError` if this is not a run dir."""
        if not self.is_run_dir():
            raise RunDirError(f"{self.root} is not a relax-hpc run dir (no {RUN_MARKER})")
        try:
            return read_json(self.marker)
        except (OSError, ValueError) as exc:
            raise RunDirError(f"cannot read {self.marker}: {exc}") from exc

    @classmethod
    def create(cls, root: Path | str, *, name: str = "run", resume: bool = False) -> RunDir:
        """Create (or, with ``resume``, reopen) a run directory and every folder of its layout.

        Refuses a non-empty folder that is not a run dir, and an existing run dir unless ``resume`` is set.
        """
        rd = cls(root)
        if rd.is_run_dir():
            if not resume:
                raise RunDirError(f"{rd.root} already holds a run ({rd.info().get('run_id')}); "
                                  "use `relax-hpc resume` or pick another --run-dir")
        elif rd.root.exists():
            if not rd.root.is_dir():
                raise RunDirError(f"{rd.root} exists and is not a folder")
            if any(rd.root.iterdir()):
                raise RunDirError(f"{rd.root} is not empty and is not a relax-hpc run dir; refusing to write there")
        try:
            rd.root.mkdir(parents=True, exist_ok=True)
            for sub in cls._FOLDERS:
                (rd.root / sub).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(f"cannot create run dir {rd.root}: {exc.strerror or exc}") from exc
        if not rd.is_run_dir():
            atomic_write_json(rd.marker, {
                "run_id": f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}",
                "name": name, "created": time.time(), "created_by": f"{socket.gethostname()}:{os.getpid()}",
                "relax_hpc_version": __version__, "protocol": 1,
            })
        return rd

    @classmethod
    def open(cls, root: Path | str) -> RunDir:
        """Open an existing run dir; :class:`RunDirError` if the folder is not one."""
        rd = cls(root)
        if not rd.root.is_dir():
            raise RunDirError(f"run dir {rd.root} does not exist")
        rd.info()
        return rd

    def ensure_layout(self) -> None:
        """Create any missing folder of the layout (roles call this at start; idempotent)."""
        for sub in self._FOLDERS:
            (self.root / sub).mkdir(parents=True, exist_ok=True)


def slurm_ids() -> dict[str, str]:
    """Slurm job/step/array ids of this process, when running under Slurm (empty dict otherwise)."""
    keys = {"SLURM_JOB_ID": "slurm_job_id", "SLURM_STEP_ID": "slurm_step_id", "SLURM_ARRAY_JOB_ID": "slurm_array_job_id",
            "SLURM_ARRAY_TASK_ID": "slurm_array_task_id", "SLURM_HET_JOB_ID": "slurm_het_job_id",
            "SLURM_RESTART_COUNT": "slurm_restart_count", "SLURM_PROCID": "slurm_procid"}
    return {v: os.environ[k] for k, v in keys.items() if k in os.environ}
