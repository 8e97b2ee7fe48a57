"""Trainer checkpoints: safetensors for tensors, JSON for everything else (never pickle on the shared filesystem).

``checkpoints/step_NNNNNNNN/`` comes in two formats, told apart by its ``state.json``:

- full (the project's): ``model.safetensors`` (full, unsharded state dict: loadable whatever the trainer's parallel
  layout and backend were), ``optimizer.safetensors`` (optimizer tensors keyed by parameter name, and the torch RNG
  states), ``state.json`` (step, policy version, param groups, data position, sample-store read position, RNG
  states, crc32 checksums of the two tensor files). Rank 0 gathers and writes it (:func:`save_checkpoint`).
- sharded (a backend's :class:`~relax_hpc.trainer.backend.ShardedCheckpoint`, e.g. megatron's
  ``dist_checkpointing``): ``<format>/`` with every rank's shards, ``rng.safetensors`` (the torch RNG states),
  ``state.json`` as above less the param groups, plus ``sharded``: the format, the recipe settings it loads with,
  and every file of ``<format>/`` with its size. Every rank writes its shards into the staging folder
  ``checkpoints/.tmp-step_NNNNNNNN.parts`` and then its ``part-rNNNNN.json``; rank 0 waits (with a timeout) for every
  rank's part, writes the rest and publishes the folder (:func:`save_sharded_checkpoint`). The formats' own
  metadata files are the format's business (megatron's: see ``relax_hpc.trainer.megatron.dist_checkpoint``).

Either way the ``COMPLETE`` marker is written last and the folder appears by one rename, then
``checkpoints/LATEST`` moves: a save killed at any point leaves the previous checkpoint the newest complete one and
only ``.tmp-`` debris. :func:`latest_checkpoint` takes the newest complete folder that verifies.
"""

from __future__ import annotations

import copy as copy_module
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from relax_hpc.fsio import atomic_write_text, is_complete, read_json, remove_debris, staged_dir
from relax_hpc.rundir import RunDir
from relax_hpc.trainer.backend import dedupe_shared

if TYPE_CHECKING:
    from relax_hpc.trainer.backend import ShardedCheckpoint

log = logging.getLogger(__name__)


def rng_state() -> tuple[dict[str, Any], dict[str, Any]]:
    """(json part, tensor part) of the python/numpy/torch RNG states."""
    import torch

    py = random.getstate()
    np_state = np.random.get_state()
    js = {"python": [py[0], list(py[1]), py[2]],
          "numpy": [np_state[0], np.asarray(np_state[1]).tolist(), int(np_state[2]), int(np_state[3]),
                    float(np_state[4])]}
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    return js, tensors


def set_rng_state(js: dict[str, Any], tensors: dict[str, Any]) -> None:
    import torch

    v, state, gauss = js["python"]
    random.setstate((v, tuple(state), gauss))
    n = js["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    if "rng.torch" in tensors:
        torch.set_rng_state(tensors["rng.torch"].cpu())
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"].cpu())


def flatten_optimizer(osd: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Optimizer state dict (keyed by parameter name) -> (tensors, json param_groups)."""
    import torch

    tensors = {}
    for pname, st in osd["state"].items():
        for k, v in st.items():
            t = v if isinstance(v, torch.Tensor) else torch.tensor(v)
            tensors[f"{pname}::{k}"] = t.detach().cpu().contiguous()
    return tensors, osd["param_groups"]


def unflatten_optimizer(tensors: dict[str, Any], groups: list[dict[str, Any]]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        pname, _, k = key.rpartition("::")
        state.setdefault(pname, {})[k] = t
    return {"state": state, "param_groups": groups}


@dataclass
class CheckpointData:
    """Everything a checkpoint writes besides its state JSON, taken at one moment (:func:`capture`)."""

    model: dict[str, Any]
    """Model tensors on the CPU, tied ones once (see ``aliases``)."""
    aliases: dict[str, str]
    optim: dict[str, Any]
    """Flattened optimizer state tensors (``<param>::<key>``)."""
    groups: list[dict[str, Any]]
    rng_js: dict[str, Any]
    rng_t: dict[str, Any]


def capture(model_sd: dict[str, Any], optim_sd: dict[str, Any] | None, *, copy: bool) -> CheckpointData:
    """Take the checkpoint's content now (the RNG states too). ``copy``: own copies of every tensor, so training may
    go on while a background thread writes them (tied tensors stay one copy)."""
    unique, aliases = dedupe_shared(model_sd)
    ot, groups = flatten_optimizer(optim_sd) if optim_sd is not None else ({}, [])
    rng_js, rng_t = rng_state()
    model = {k: v.detach().cpu().contiguous() for k, v in unique.items()}
    if copy:  # CPU tensors above may be the live ones
        model = {k: v.clone() for k, v in model.items()}
        ot = {k: v.clone() for k, v in ot.items()}
        groups = copy_module.deepcopy(groups)
    return CheckpointData(model, aliases, ot, groups, rng_js, rng_t)


def save_checkpoint(run_dir: RunDir, step: int, *, model_sd: dict[str, Any] | None = None,
                    optim_sd: dict[str, Any] | None = None, state: dict[str, Any], keep: int = 2,
                    data: CheckpointData | None = None) -> Path:
    """Publish ``checkpoints/step_<step>`` atomically and move LATEST. Only the leader rank calls this. The content
    is ``data`` (from :func:`capture`) or, if not given, taken from ``model_sd`` / ``optim_sd`` now."""
    from safetensors.torch import save_file

    from relax_hpc.fsio import atomic_write_json

    if data is None:
        data = capture(model_sd or {}, optim_sd, copy=False)
    final = run_dir.checkpoint(step)
    if is_complete(final):
        shutil.rmtree(final)  # re-saving the same step (e.g. on a signal right after a periodic save)
    with staged_dir(final) as tmp:
        save_file(data.model, str(tmp / "model.safetensors"))
        save_file({**data.optim, **data.rng_t}, str(tmp / "optimizer.safetensors"))
        sums = {name: file_checksum(tmp / name) for name in TENSOR_FILES}
        atomic_write_json(tmp / "state.json", {**state, "step": step, "param_groups": data.groups,
                                               "rng": data.rng_js, "aliases": data.aliases, "checksums": sums})
    atomic_write_text(run_dir.checkpoints_latest, f"{step}\n")
    _retention(run_dir, keep)
    log.info("checkpoint step %d saved to %s", step, final)
    return final


def _retention(run_dir: RunDir, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; remove the debris of saves killed over an hour ago."""
    done = sorted(p for p in run_dir.checkpoints.glob("step_*") if is_complete(p))
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
    remove_debris(run_dir.checkpoints)


TENSOR_FILES = ("model.safetensors", "optimizer.safetensors")
"""The tensor files of a full checkpoint."""
SHARDED_TENSOR_FILES = ("rng.safetensors",)
"""The tensor files of a sharded checkpoint besides its format's folder."""


def tensor_files(state: dict[str, Any]) -> tuple[str, ...]:
    """The safetensors files (checksummed in ``state.json``) of the checkpoint whose state JSON is ``state``."""
    return SHARDED_TENSOR_FILES if "sharded" in state else TENSOR_FILES
_CHUNK = 16 << 20


def file_checksum(path: Path) -> dict[str, Any]:
    """``{"bytes", "crc32"}`` of a whole file (read in 16 MiB pieces; zlib's crc32 runs at about 1 GB/s)."""
    import zlib

    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def checksum_problem(path: Path, state: dict[str, Any]) -> str | None:
    """Why the tensor files of checkpoint ``path`` do not match the checksums its ``state.json`` recorded (None:
    they match, or it recorded none: a checkpoint written before checksums existed)."""
    sums = state.get("checksums")
    if not isinstance(sums, dict):
        return None
    for name in tensor_files(state):
        want = sums.get(name)
        if not isinstance(want, dict):
            continue
        try:
            got = file_checksum(path / name)
        except OSError as exc:
            return f"{path / name}: {exc.strerror or exc}"
        if got != want:
            return f"{path / name}: checksum mismatch ({got['bytes']} bytes, crc32 {got['crc32']}; state.json " \
                   f"recorded {want.get('bytes')} bytes, crc32 {want.get('crc32')})"
    return None


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint folder ``path`` cannot be resumed from, or None if it is complete and verified: the
    marker, a readable ``state.json`` with its keys, the safetensors files whose header parses and whose data
    covers the file (a truncated file fails here), and their bytes against the crc32 checksums ``state.json``
    recorded at save time (a flipped bit in a tensor fails here). A sharded checkpoint's shard files are checked
    for presence and size only (:func:`shard_files_problem`: every rank reads this, and reading every shard would
    read the whole model). Reads the safetensors files once."""
    from safetensors import safe_open

    if not is_complete(path):
        return "not complete (no COMPLETE marker)"
    try:
        state = read_json(path / "state.json", expect=dict)
    except (OSError, ValueError) as exc:
        return str(exc)
    keys = ("step", "rng", "sharded") if "sharded" in state else ("step", "rng", "param_groups")
    missing = [k for k in keys if k not in state]
    if missing or not isinstance(state.get("step"), int):
        return f"{path / 'state.json'} lacks {', '.join(missing) or 'an integer step'}"
    for name in tensor_files(state):
        try:
            with safe_open(str(path / name), "pt"):
                pass
        except Exception as exc:  # SafetensorError, OSError: a missing, truncated or garbage file
            return f"{path / name}: {str(exc)[:200]}"
    return checksum_problem(path, state) or shard_files_problem(path, state)


def shard_files_problem(path: Path, state: dict[str, Any]) -> str | None:
    """Why the shard files a sharded checkpoint's ``state.json`` lists are not all in ``path`` with their recorded
    sizes (None: they are, or it is a full checkpoint)."""
    sharded = state.get("sharded")
    if sharded is None:
        return None
    files = sharded.get("files") if isinstance(sharded, dict) else None
    if not isinstance(files, dict) or not files or not isinstance(sharded.get("format"), str):
        return f"{path / 'state.json'}: its sharded part lacks the format or the list of shard files"
    for name, size in files.items():
        try:
            got = (path / name).stat().st_size
        except OSError as exc:
            return f"{path / name}: {exc.strerror or exc} (a rank's shards are missing)"
        if got != size:
            return f"{path / name}: {got} bytes, state.json recorded {size}"
    return None


def latest_checkpoint(run_dir: RunDir) -> Path | None:
    """The newest complete and verified checkpoint (a scan of the folders, newest first), or None. A damaged
    one is skipped with a warning: resuming from an older complete checkpoint beats failing the run."""
    found = sorted((p for p in run_dir.checkpoints.glob("step_*") if is_complete(p)), reverse=True)
    for p in found:  # LATEST is only a hint for people; the complete folders are the truth
        problem = checkpoint_problem(p)
        if problem is None:
            return p
        log.warning("checkpoint %s is not usable (%s); trying an older one", p, problem)
    return None


def load_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """(model state dict, optimizer state dict or None, state json). Sets the RNG states."""
    from safetensors.torch import load_file

    state = read_json(path / "state.json")
    model_sd = load_file(str(path / "model.safetensors"))
    for alias, name in state.get("aliases", {}).items():
        model_sd[alias] = model_sd[name]
    ot = load_file(str(path / "optimizer.safetensors"))
    rng_t = {k: v for k, v in ot.items() if k.startswith("rng.")}
    ot = {k: v for k, v in ot.items() if not k.startswith("rng.")}
    set_rng_state(state["rng"], rng_t)
    optim_sd = unflatten_optimizer(ot, state["param_groups"]) if state["param_groups"] else None
    return model_sd, optim_sd, state


def read_checkpoint_state(path: Path) -> dict[str, Any]:
    """The ``state.json`` of checkpoint ``path`` (its ``sharded`` key tells the format: absent for a full one)."""
    return read_json(path / "state.json", expect=dict)


def _part(staging: Path, rank: int) -> Path:
    return staging / f"part-r{rank:05d}.json"


def _barrier(world_size: int) -> None:
    """Every trainer rank here (the process group's timeout bounds it)."""
    if world_size > 1:
        import torch.distributed as dist

        dist.barrier()


def save_sharded_checkpoint(run_dir: RunDir, step: int, sharded: ShardedCheckpoint, *, rank: int, world_size: int,
                            state: dict[str, Any], keep: int, timeout_s: float) -> Path | None:
    """Every trainer rank calls (a collective): each writes its shards into the staging folder's ``<format>/``, then
    its part file; rank 0 waits up to ``timeout_s`` for every rank's part, writes the RNG states and ``state.json``,
    publishes ``checkpoints/step_<step>`` and moves LATEST. Returns the folder on rank 0 (None elsewhere: the
    leader publishes it later). Raises :class:`~relax_hpc.errors.WaitTimeout` on rank 0 when a part is missing."""
    from relax_hpc.fsio import atomic_write_json

    staging = run_dir.checkpoint_staging(step)
    rng = rng_state() if rank == 0 else None  # taken before anything else runs
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a killed attempt's parts of this step
        (staging / sharded.name).mkdir(parents=True, exist_ok=True)
    _barrier(world_size)  # the fresh folder exists before any rank writes
    (staging / sharded.name).mkdir(parents=True, exist_ok=True)  # a lookup on the server (NFS caches a missing one)
    sharded.save(staging / sharded.name)
    atomic_write_json(_part(staging, rank), {"rank": rank, "world_size": world_size, "step": step})
    if rank != 0:
        return None
    assert rng is not None
    _wait_parts(staging, step, world_size, timeout_s)
    return _publish_sharded(run_dir, staging, step, sharded, rng, state=state, world_size=world_size, keep=keep)


def _wait_parts(staging: Path, step: int, world_size: int, timeout_s: float) -> None:
    """Until every rank's part file of ``step`` is in ``staging``; :class:`WaitTimeout` naming the missing ranks."""
    from relax_hpc.errors import WaitTimeout
    from relax_hpc.fsio import refresh_nfs_cache, wait_for

    def missing() -> list[int]:
        refresh_nfs_cache(_part(staging, 0))
        return [r for r in range(world_size) if not _part(staging, r).is_file()]

    try:
        wait_for(lambda: not missing(), what=f"every trainer rank's part of checkpoint step {step} in {staging}",
                 timeout_s=timeout_s, logger=log)
    except WaitTimeout as exc:
        raise WaitTimeout(f"{exc} (ranks {missing()} never finished writing; the checkpoint is not published: "
                          "the previous one stays the latest)") from None


def _publish_sharded(run_dir: RunDir, staging: Path, step: int, sharded: ShardedCheckpoint,
                     rng: tuple[dict[str, Any], dict[str, Any]], *, state: dict[str, Any], world_size: int,
                     keep: int) -> Path:
    """Rank 0, every part in: the parts out, the RNG states and ``state.json`` (with the shard files and their
    sizes) in, the folder published, LATEST moved, retention applied."""
    from safetensors.torch import save_file

    from relax_hpc.fsio import atomic_write_json, publish_dir

    for r in range(world_size):
        _part(staging, r).unlink()
    folder = staging / sharded.name
    files = {str(p.relative_to(staging)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}
    save_file(rng[1], str(staging / "rng.safetensors"))
    sums = {name: file_checksum(staging / name) for name in SHARDED_TENSOR_FILES}
    info = {"format": sharded.name, "layout": sharded.layout(), "elsewhere": sharded.elsewhere,
            "world_size": world_size, "files": files}
    atomic_write_json(staging / "state.json", {**state, "step": step, "rng": rng[0], "sharded": info,
                                               "checksums": sums})
    final = run_dir.checkpoint(step)
    if final.exists():
        shutil.rmtree(final)  # re-saving the same step (e.g. on a signal right after a periodic save)
    publish_dir(staging, final)
    atomic_write_text(run_dir.checkpoints_latest, f"{step}\n")
    _retention(run_dir, keep)
    log.info("checkpoint step %d saved to %s (%s, %d ranks' shards)", step, final, sharded.name, world_size)
    return final


def load_sharded_checkpoint(path: Path, state: dict[str, Any], sharded: ShardedCheckpoint) -> None:
    """The sharded checkpoint ``path`` (``state``: its state JSON) into the backend (every rank calls), then the RNG
    states."""
    from safetensors.torch import load_file

    sharded.load(path / sharded.name)
    set_rng_state(state["rng"], load_file(str(path / "rng.safetensors")))
