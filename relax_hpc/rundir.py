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
      samples/announce/             one empty file per published, unconsumed shard: the planner's index
      samples/heads/<writer>.json   each writer's newest shard names, replaced by rename (read by name)
      samples/tmp/                  writers' temporary files (same filesystem, for atomic renames)
      samples/quarantine/           corrupt shards, moved aside with a reason file
      samples/consumers/<name>/     a consumer group's committed read position and per-step batch plans
      weights/vNNNNNN/              published weight snapshots (safetensors + manifest.json + COMPLETE)
      weights/LATEST                the newest complete snapshot's version (one small read)
      eval/vNNNNNN.json             held-out evaluation of weights version N (+ .samples.jsonl, one line a sample)
      weights/leases/               readers' leases on snapshots they are loading
      weights/pins/                 pinned versions, never deleted by retention
      checkpoints/step_NNNNNNNN/    trainer checkpoints (COMPLETE marker); checkpoints/LATEST
      checkpoints/.tmp-step_NNNNNNNN.parts/  every trainer rank's shards of a sharded checkpoint being written
      logs/events/<proc>.jsonl      each process's event and metric lines (single writer)
      logs/<proc>.log               each process's text log
      logs/tensorboard/<proc>/      TensorBoard event files (when monitor.tensorboard is on)
      logs/wandb/                   offline W&B runs (when monitor.wandb is on)
      heartbeats/<proc>.json        each process's heartbeat, rewritten atomically
      supervisor/<proc>.json        how often the role supervisor restarted a process, and why (its one writer)
      supervisor/groups/<group>.json  the restart generation of a process group (every rank restarts together)
      rendezvous/<group>.json       address of a torch.distributed store for the fast path
      control/                      requests to roles (drain, stop) written by the CLI
      servers/<proc>-<k>.json       an inference server a rollout process started (host, port, pid, command, log)
      servers/<proc>-<k>/model/     the model folder that server loaded at start (server engines, tiny models)
      servers/<proc>-<k>/views/     HF-loadable views of snapshots (links + config.json) that server loaded
      launch.json                   what the launcher started (executor, Slurm job ids or local pids)
      STATUS.json                   the run's final state (completed / failed), written when it ends
      slurm/                        sbatch scripts, submitit folders, jobs.json
      export/                       the final model in HF format
      exports/vNNNNNN[-merged]/     snapshots written as HF folders by `relax-hpc export` (-merged: LoRA merged in)
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from relax_hpc import __version__
from relax_hpc.errors import RunDirError, StateFileError
from relax_hpc.fsio import TMP_PREFIX, atomic_write_json, read_json

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
    # The folders every shard write joins are computed once per RunDir (a writer makes three paths per shard).
    @cached_property
    def samples(self) -> Path:
        return self.root / "samples"

    @cached_property
    def shards(self) -> Path:
        return self.samples / "shards"

    def writer_shards(self, writer_id: str) -> Path:
        return self.shards / writer_id

    @cached_property
    def announce(self) -> Path:
        """The announcements of published shards: one empty file ``<writer_id>.<shard name>`` per shard, created
        by its writer after the shard's rename (the planner lists this one folder instead of every writer's)."""
        return self.samples / "announce"

    def announce_file(self, writer_id: str, name: str) -> Path:
        """The announcement of shard ``name`` of ``writer_id``."""
        return self.announce / f"{writer_id}.{name}"

    @cached_property
    def heads(self) -> Path:
        """Per writer, the names of its newest shards (``<writer_id>.json``, replaced by rename after each publish):
        the planner reads them by name, so a directory cache that hides new announcements does not delay them."""
        return self.samples / "heads"

    def head_file(self, writer_id: str) -> Path:
        """The head of ``writer_id``: ``{"shards": [newest shard names]}``."""
        return self.heads / f"{writer_id}.json"

    @cached_property
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

    def consumer_planned(self, name: str = "trainer") -> Path:
        """The consumer's latest *planned* position (writers read it to compute their backlog)."""
        return self.consumer(name) / "planned.json"

    def shard_file(self, writer_id: str, name: str) -> Path:
        """A published shard of one writer incarnation (``name`` as made by ``relax_hpc.store.layout``)."""
        return self.writer_shards(writer_id) / name

    def samples_tmp_file(self, name: str) -> Path:
        """A writer's temporary file, renamed into ``writer_shards`` when complete."""
        return self.samples_tmp / name

    def quarantine_file(self, name: str) -> Path:
        """A quarantined shard (``<writer>.<shard name>``) or its reason file (``... .reason.json``)."""
        return self.quarantine / name

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

    def weight_pin(self, version: int) -> Path:
        """The file whose existence pins snapshot ``version`` against retention."""
        return self.weight_pins / f"v{version:06d}"

    def weight_lease(self, reader: str) -> Path:
        """The lease file of one reader (one lease per reader name)."""
        return self.weight_leases / f"{reader}.json"

    def snapshot_staging(self, version: int, token: str) -> Path:
        """Shared staging folder where trainer ranks write parts of ``version`` before the leader commits it.

        ``token`` identifies one incarnation of the trainer job, so parts of a killed attempt are never mixed in.
        The name starts with the debris prefix, so a folder left by a killed attempt is cleaned up later.
        """
        return self.weights / f"{TMP_PREFIX}v{version:06d}.parts-{token}"

    # ---------------------------------------------------------------- evaluation
    @property
    def evals(self) -> Path:
        """Held-out evaluations: ``vNNNNNN.json`` (the metrics of weights version N, written once, atomically) and
        ``vNNNNNN.samples.jsonl`` (one line per sample: prompt index, source, response, reward, version)."""
        return self.root / "eval"

    def eval_summary(self, version: int) -> Path:
        return self.evals / f"v{version:06d}.json"

    def eval_samples(self, version: int) -> Path:
        return self.evals / f"v{version:06d}.samples.jsonl"

    # ---------------------------------------------------------------- checkpoints
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step_{step:08d}"

    @property
    def checkpoints_latest(self) -> Path:
        return self.checkpoints / "LATEST"

    def checkpoint_staging(self, step: int) -> Path:
        """Shared staging folder where every trainer rank writes its shards of a sharded checkpoint of ``step``
        before the leader publishes it as :meth:`checkpoint` (a debris name: a killed save leaves only debris)."""
        return self.checkpoints / f"{TMP_PREFIX}step_{step:08d}.parts"

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
    def tensorboard(self) -> Path:
        """TensorBoard log folder of the run (point ``tensorboard --logdir`` here)."""
        return self.logs / "tensorboard"

    def tensorboard_dir(self, proc: str) -> Path:
        """One process's TensorBoard event files (a separate TensorBoard "run" per process)."""
        return self.tensorboard / proc

    @property
    def wandb(self) -> Path:
        """Where W&B keeps its (offline) runs."""
        return self.logs / "wandb"

    @property
    def heartbeats(self) -> Path:
        return self.root / "heartbeats"

    def heartbeat(self, proc: str) -> Path:
        return self.heartbeats / f"{proc}.json"

    @property
    def supervisor(self) -> Path:
        """The role supervisor's restart records, one per supervised process."""
        return self.root / "supervisor"

    def restarts_file(self, proc: str) -> Path:
        """Restarts of one process: ``{"proc", "role", "rank", "restarts", "history": [...]}``."""
        return self.supervisor / f"{proc}.json"

    def group_restart_file(self, group: str) -> Path:
        """The restart generation of a process group (a trainer of several ranks): ``{"group", "generation",
        "by", "reason", "time"}``; a supervisor whose rank died raises it, every rank's supervisor then restarts its
        rank."""
        return self.supervisor / "groups" / f"{group}.json"

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
    def claims(self) -> Path:
        """Rollout workers' claims on room in the sample store (admission control): one file per worker."""
        return self.root / "claims"

    def claim_file(self, proc: str) -> Path:
        return self.claims / f"{proc}.json"

    @property
    def servers(self) -> Path:
        """Inference servers started by rollout processes (server engines): one record per server."""
        return self.root / "servers"

    def server_record(self, name: str) -> Path:
        """Where a server's host, port, pid, command and log path are recorded (``rollout-0-0``)."""
        return self.servers / f"{name}.json"

    def server_log(self, name: str) -> Path:
        """A server's stdout and stderr."""
        return self.logs / f"server-{name}.log"

    def server_views(self, name: str) -> Path:
        """HF-loadable views of snapshot folders for a server (links to the snapshot's files + config.json)."""
        return self.servers / name / "views"

    def server_model(self, name: str) -> Path:
        """The HF model folder a server loads at start when the model exists only in memory (tiny models)."""
        return self.servers / name / "model"

    @property
    def slurm(self) -> Path:
        return self.root / "slurm"

    @property
    def slurm_jobs(self) -> Path:
        return self.slurm / "jobs.json"

    def slurm_script(self, name: str) -> Path:
        """A rendered sbatch script of the run (``hetjob``, ``trainer``, ``rollout-4-7`` ...)."""
        return self.slurm / f"{name}.sbatch"

    def slurm_output(self, name: str, job: str = "%j") -> Path:
        """Output of a job's batch script; ``job`` is a Slurm filename pattern (``%j``, ``%A_%a``) or a job id."""
        return self.slurm / f"{name}-{job}.out"

    @property
    def launch_record(self) -> Path:
        """What the launcher started: ``{"executor": "local"|"slurm", "jobs": [...], "procs": [...]}``."""
        return self.root / "launch.json"

    @property
    def status_file(self) -> Path:
        """The run's final state, written by the last role to finish: ``{"state": "completed"|"failed", ...}``."""
        return self.root / "STATUS.json"

    @property
    def export(self) -> Path:
        return self.root / "export"

    def exported(self, version: int, *, merged: bool = False) -> Path:
        """Where ``relax-hpc export`` writes snapshot ``version`` as an HF folder (``merged``: a LoRA adapter merged
        into its base)."""
        return self.root / "exports" / f"v{version:06d}{'-merged' if merged else ''}"

    # ---------------------------------------------------------------- lifecycle
    _FOLDERS = ("samples/shards", "samples/announce", "samples/heads", "samples/tmp", "samples/quarantine",
                "samples/consumers", "weights/leases", "weights/pins", "checkpoints", "logs/events", "heartbeats",
                "supervisor",
                "rendezvous", "control", "slurm", "config")

    def is_run_dir(self) -> bool:
        return self.marker.is_file()

    def info(self) -> dict[str, Any]:
        """The content of ``RUN.json``. Raises :class:`RunDirError` if this is not a run dir."""
        if not self.is_run_dir():
            raise RunDirError(f"{self.root} is not a relax-hpc run dir (no {RUN_MARKER})")
        try:
            return read_json(self.marker, expect=dict)
        except StateFileError:
            raise
        except OSError as exc:
            raise RunDirError(f"cannot read {self.marker}: {exc.strerror or exc}") from exc

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
    keys = {"SLURM_JOB_ID": "slurm_job_id", "SLURM_STEP_ID": "slurm_step_id",
            "SLURM_ARRAY_JOB_ID": "slurm_array_job_id",
            "SLURM_ARRAY_TASK_ID": "slurm_array_task_id", "SLURM_HET_JOB_ID": "slurm_het_job_id",
            "SLURM_RESTART_COUNT": "slurm_restart_count", "SLURM_PROCID": "slurm_procid"}
    return {v: os.environ[k] for k, v in keys.items() if k in os.environ}


@dataclass(frozen=True)
class SweepDir:
    """Paths of one sweep directory: a manifest, the Slurm array script and one run dir per combination.

    Layout::

        SWEEP_DIR/
          sweep.json                the grid, one entry per combination (overrides, label, run dir)
          launch.json               how the sweep was started (Slurm array job id, or local)
          runs/NNN-<label>/         one complete run dir per combination
          slurm/sweep.sbatch        the job array script; slurm/sweep-<array>_<task>.out its outputs
          logs/NNN.log              output of a locally run combination
    """

    root: Path

    def __init__(self, root: Path | str):
        object.__setattr__(self, "root", Path(root).expanduser().absolute())

    @property
    def manifest(self) -> Path:
        return self.root / "sweep.json"

    @property
    def launch_record(self) -> Path:
        return self.root / "launch.json"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    def run(self, index: int, label: str) -> Path:
        """Run dir of combination ``index`` (``label`` must already be filename-safe)."""
        return self.runs / f"{index:03d}-{label}" if label else self.runs / f"{index:03d}"

    @property
    def slurm(self) -> Path:
        return self.root / "slurm"

    @property
    def slurm_script(self) -> Path:
        return self.slurm / "sweep.sbatch"

    def slurm_output(self, job: str = "%A_%a") -> Path:
        return self.slurm / f"sweep-{job}.out"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def local_log(self, index: int) -> Path:
        return self.logs / f"{index:03d}.log"
