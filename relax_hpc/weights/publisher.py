"""Publishing versioned weight snapshots: one process with the full state dict, or several ranks with parts.

One process (:meth:`SnapshotPublisher.publish`): the state dict is split into safetensors files of at most
``max_file_bytes`` inside a ``.tmp-`` folder; the manifest is written, then ``COMPLETE`` last, and the folder is
renamed to ``weights/vNNNNNN`` (:func:`relax_hpc.fsio.staged_dir`); only then does ``weights/LATEST`` move.

Several ranks (:meth:`SnapshotPublisher.publish_part`): each rank writes its files and then a ``part-rNNNNN.json``
(its commit point) into the shared staging folder :meth:`RunDir.snapshot_staging`. Rank 0, the leader, waits (with a
timeout) until every rank's part is there, checks that the parts fit together (no duplicate names, shards tile their
tensors), writes the manifest and ``COMPLETE``, renames the folder into place and moves LATEST. A part is either a
whole tensor under its full name, or a :class:`Shard` (a slice of the full tensor along one dim); readers always see
full tensors under full names.

Every complete snapshot published with a ``model_config`` is also an HF model folder (:func:`write_hf_files`):
``config.json``, ``generation_config.json``, whole tensors under their HF names in ``model.safetensors`` (one file)
or ``model-0000K-of-0000N.safetensors`` with ``model.safetensors.index.json`` (several), so
``AutoModelForCausalLM.from_pretrained(snapshot_dir)`` works and server engines reload from it. A multi-rank snapshot
with sharded pieces has no index (its tensors are not whole in any file); readers of this package still load it.

A publish killed at any point leaves only ``.tmp-`` debris (removed after ``debris_after_s``) and LATEST naming the
previous complete version.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from relax_hpc.errors import RunDirError, SnapshotError, WaitTimeout
from relax_hpc.fsio import (
    COMPLETE_MARKER,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    fsync_dir,
    fsync_file,
    is_complete,
    oserror_message,
    read_json,
    remove_debris,
    staged_dir,
    tmp_name,
    wait_for,
)
from relax_hpc.rundir import RunDir
from relax_hpc.weights import retention
from relax_hpc.weights.delta import DELTA_FILE, DeltaPolicy, base_bytes, encode_delta
from relax_hpc.weights.format import HashPipeline, st_dtype, tensor_nbytes, write_file
from relax_hpc.weights.manifest import (
    FORMAT,
    MANIFEST,
    PROTOCOL,
    check_pieces,
    complete_versions,
    latest_version,
    read_manifest,
    write_latest,
)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""A LoRA snapshot's tensors (PEFT's file name)."""
ADAPTER_CONFIG = "adapter_config.json"
"""A LoRA snapshot's adapter config (PEFT's file name)."""

if TYPE_CHECKING:
    import torch

    from relax_hpc.events import EventLog

log = logging.getLogger(__name__)


class Shard(NamedTuple):
    """A rank's slice of a tensor: ``full[offset:offset + part.shape[dim]]`` along ``dim`` of ``full_shape``."""

    dim: int
    offset: int
    full_shape: tuple[int, ...]


def default_token() -> str:
    """An id of this trainer incarnation that every rank of it computes alike (Slurm or torchrun restart ids)."""
    env = os.environ
    if "SLURM_JOB_ID" in env:
        return f"{env['SLURM_JOB_ID']}.{env.get('SLURM_RESTART_COUNT', '0')}"
    if "TORCHELASTIC_RUN_ID" in env:
        return f"{env['TORCHELASTIC_RUN_ID']}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return "0"


def _part_meta(folder: Path, rank: int) -> Path:
    return folder / f"part-r{rank:05d}.json"


class SnapshotPublisher:
    """Writes weight snapshots into ``RUN_DIR/weights`` and applies retention. One publisher (leader) per run."""

    def __init__(self, run_dir: RunDir | Path | str, *, keep_last: int = 3, max_file_bytes: int = 512 << 20,
                 debris_after_s: float = 600.0, part_timeout_s: float = 600.0, events: EventLog | None = None,
                 delta: DeltaPolicy | None = None):
        self.rd = RunDir.open(run_dir.root if isinstance(run_dir, RunDir) else run_dir)
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        if max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be positive, got {max_file_bytes}")
        self.keep_last = keep_last
        self.max_file_bytes = max_file_bytes
        self.debris_after_s = debris_after_s
        self.part_timeout_s = part_timeout_s
        self.events = events
        self.delta = delta
        """Write versions as deltas of the last full one (:mod:`relax_hpc.weights.delta`); None: always full."""
        self._base: tuple[int, dict[str, Any]] | None = None
        """The last full version this publisher wrote and a copy of its bytes (the base of the next deltas)."""
        self._housekeeping: threading.Thread | None = None
        self._last_hf: tuple[Path, list[dict[str, Any]]] | None = None
        """The last snapshot this publisher committed and its HF side files (their entries): unchanged files are
        hard-linked from there (:func:`write_hf_files`)."""
        self._hf_memo: dict[str, tuple[str, bytes, str]] = {}
        """The HF side files' last content (compact JSON), bytes and sha256 by name: not encoded again unchanged."""
        self._newest: int | None = None
        """The newest version this publisher committed (one leader per run: nothing newer appears on disk)."""
        try:
            for folder in (self.rd.weights, self.rd.weight_leases, self.rd.weight_pins):
                folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(oserror_message(exc, self.rd.weights)) from exc

    # ------------------------------------------------------------------ public API
    def next_version(self) -> int:
        """One above the newest published version (1 for a fresh run); what a resumed trainer should publish next."""
        versions = complete_versions(self.rd)
        return max([latest_version(self.rd) or 0, *versions]) + 1

    def is_new(self, version: int) -> bool:
        """True if ``version`` is newer than LATEST and than every complete snapshot on disk (LATEST may lag a
        folder published just before a kill, or be damaged): a resumed trainer publishes only such versions."""
        if self._newest is not None and version > self._newest:  # the leader's own last commit is the newest
            return True
        versions = complete_versions(self.rd)
        latest = latest_version(self.rd)
        return version > max(-1 if latest is None else latest, versions[-1] if versions else -1)

    def adopt(self, version: int) -> bool:
        """For a version that is not new (:meth:`is_new`): where its complete folder is on disk and LATEST is older
        (a publish killed between its rename and the LATEST write, then the step trained again after a resume), move
        LATEST to it. Without this, readers that follow LATEST stay on the older version for good. True if moved."""
        folder = self.rd.snapshot(version)
        latest = latest_version(self.rd)
        if (latest is not None and latest >= version) or not is_complete(folder):
            return False
        manifest = read_manifest(folder)
        write_latest(self.rd, version, int(manifest.get("step", version)), float(manifest.get("time", time.time())))
        # not ``self._newest``: newer folders than this one may be on disk (LATEST lost, resumed from an older step)
        log.warning("LATEST named v%06d, older than the complete snapshot v%06d on disk: moved to it", latest or 0,
                    version)
        return True

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int, step: int,
                model_config: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
                generation_config: Mapping[str, Any] | None = None,
                adapter: Mapping[str, Any] | None = None) -> Path:
        """Publish a full state dict as snapshot ``version``; returns its folder once LATEST names it. With
        ``model_config`` (the HF ``config.json`` content) the folder is also an HF model folder.

        ``adapter`` (``{"config": adapter_config.json content, "base": {"path", "sha256"}}``): ``state_dict`` is a
        LoRA adapter's tensors; the folder is then a PEFT adapter folder (``adapter_model.safetensors``, one file,
        and ``adapter_config.json``) and the manifest's ``adapter`` names the base model (``model_config`` stays the
        base's config, no HF model files are written)."""
        self._check_version(version)
        items = self._items(state_dict)
        if self.delta is not None:
            folder = self._publish_delta(items, version, step, model_config, extra)
            if folder is not None:
                return folder
        t0 = time.monotonic()
        final = self.rd.snapshot(version)
        durable: set[str] = set()  # the tensor files (fsynced as written) and linked HF files: no second fsync
        with staged_dir(final, marker_content=str(version), durable=durable) as tmp:
            files, tensors = self._write(tmp, items, rank=0, world_size=1, shards={},
                                         one_file=ADAPTER_WEIGHTS if adapter is not None else None)
            durable.update(f["name"] for f in files)
            manifest = self._manifest(version, step, files, tensors, 1, model_config, extra)
            if adapter is not None:
                manifest["adapter"] = {"base": dict(adapter["base"] or {}), "weights": ADAPTER_WEIGHTS,
                                       "config": ADAPTER_CONFIG}
                manifest["hf_files"] = [write_adapter_config(tmp, adapter["config"])]
            else:
                manifest["hf_files"] = write_hf_files(tmp, manifest, generation_config, previous=self._last_hf,
                                                      memo=self._hf_memo, linked=durable)
            atomic_write_json(tmp / MANIFEST, manifest, fsync=False, indent=None)  # C encoder: 0.04 ms, not 0.2
        self._last_hf = (final, manifest["hf_files"])
        if self.delta is not None:
            self._base = (version, base_bytes(dict(items)))
        self._finish(version, step, manifest, t0)
        return final

    def _publish_delta(self, items: list[tuple[str, torch.Tensor]], version: int, step: int,
                       model_config: Mapping[str, Any] | None, extra: Mapping[str, Any] | None) -> Path | None:
        """Publish ``version`` as a delta of the last full version; None (nothing written) where a full version is
        due: no base yet (or it is gone), ``every_full`` reached, or the delta larger than ``max_fraction``."""
        policy, base = self.delta, self._base
        assert policy is not None
        if base is None or version - base[0] >= policy.every_full or not is_complete(self.rd.snapshot(base[0])):
            return None
        t0 = time.monotonic()
        payloads, pieces = encode_delta(dict(items), base[1], policy.codec)
        full_bytes = sum(tensor_nbytes(t) for _, t in items)
        size = sum(len(p) for p in payloads)
        if size > policy.max_fraction * full_bytes:
            log.info("delta of v%06d is %.1f%% of the full size (> %.0f%%): writing it full", version,
                     100 * size / full_bytes, 100 * policy.max_fraction)
            return None
        final = self.rd.snapshot(version)
        with staged_dir(final, marker_content=str(version)) as tmp:
            digest = hashlib.sha256()
            with open(tmp / DELTA_FILE, "wb") as f:
                for p in payloads:
                    f.write(p)
                    digest.update(p)
            files = [{"name": DELTA_FILE, "bytes": size, "sha256": digest.hexdigest(), "tensors": list(pieces)}]
            tensors = {name: {"dtype": st_dtype(t), "shape": list(t.shape), "pieces": [pieces[name]]}
                       for name, t in items}
            manifest = self._manifest(version, step, files, tensors, 1, model_config, extra)
            manifest.update(delta={"base": base[0], "full_bytes": full_bytes, "codec": policy.codec}, hf_files=[])
            atomic_write_json(tmp / MANIFEST, manifest, fsync=False, indent=None)
        self._finish(version, step, manifest, t0)
        return final

    def publish_part(self, tensors: Mapping[str, torch.Tensor], *, version: int, step: int, rank: int,
                     world_size: int, shards: Mapping[str, Shard] | None = None, token: str | None = None,
                     model_config: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None,
                     generation_config: Mapping[str, Any] | None = None) -> Path:
        """Write this rank's part of snapshot ``version``; rank 0 also waits for all parts and commits.

        ``tensors`` maps full tensor names to whole tensors, or, for names in ``shards``, to this rank's slice.
        ``token`` must be the same on every rank of one trainer incarnation (default: :func:`default_token`).
        Returns the snapshot folder (complete when rank 0 returns). Rank 0 raises :class:`WaitTimeout` naming the
        missing ranks after ``part_timeout_s``.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self._check_version(version)
        shards = dict(shards or {})
        items = self._items(tensors)
        unknown = sorted(set(shards) - {k for k, _ in items})
        if unknown:
            raise SnapshotError(f"shards given for tensors not in this part: {unknown[:5]}")
        token = re.sub(r"[^A-Za-z0-9_.-]", "_", token if token is not None else default_token())
        t0 = time.monotonic()
        staging = self.rd.snapshot_staging(version, token)
        try:
            staging.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirError(oserror_message(exc, staging)) from exc
        meta = _part_meta(staging, rank)
        meta.unlink(missing_ok=True)  # a stale part of this rank must not count while we rewrite it
        files, index = self._write(staging, items, rank=rank, world_size=world_size, shards=shards)
        atomic_write_json(meta, {"rank": rank, "world_size": world_size, "token": token, "version": version,
                                 "step": step, "files": files, "tensors": index})
        if rank != 0:
            return self.rd.snapshot(version)
        parts = self._wait_parts(staging, version, world_size, token)
        files, index = self._merge(parts)
        manifest = self._manifest(version, step, files, index, world_size, model_config, extra)
        manifest["hf_files"] = write_hf_files(staging, manifest, generation_config, fsync=True,
                                              previous=self._last_hf, memo=self._hf_memo)
        self._commit(staging, version, manifest)
        self._last_hf = (self.rd.snapshot(version), manifest["hf_files"])
        self._finish(version, step, manifest, t0)
        return self.rd.snapshot(version)

    def pin(self, version: int, reason: str = "") -> None:
        """Keep ``version`` whatever retention says."""
        retention.pin(self.rd, version, reason)

    def unpin(self, version: int) -> None:
        """Let retention delete ``version`` again."""
        retention.unpin(self.rd, version)

    def apply_retention(self) -> list[int]:
        """Delete snapshots beyond the last ``keep_last`` that are not pinned, LATEST or leased; returns them."""
        return retention.apply_retention(self.rd, self.keep_last)

    def clean_debris(self, older_than_s: float | None = None) -> list[Path]:
        """Remove ``.tmp-`` folders and files of killed publishes older than ``older_than_s``."""
        age = self.debris_after_s if older_than_s is None else older_than_s
        return [p for folder in (self.rd.weights, self.rd.weight_leases, self.rd.weight_pins)
                for p in remove_debris(folder, older_than_s=age)]

    # ------------------------------------------------------------------ internals
    def _check_version(self, version: int) -> None:
        self.wait_housekeeping()
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise SnapshotError(f"snapshot version must be a non-negative integer, got {version!r}")
        latest = latest_version(self.rd)
        if latest is not None and version <= latest:
            raise SnapshotError(f"version {version} is not newer than LATEST ({latest}) in {self.rd.weights}; "
                                f"publish {self.next_version()} or above")
        folder = self.rd.snapshot(version)
        if folder.exists() and not is_complete(folder):  # debris of a killed writer or a half-done deletion
            log.warning("removing incomplete snapshot folder %s before publishing version %d", folder, version)
            shutil.rmtree(folder, ignore_errors=True)
        if folder.exists():
            raise SnapshotError(f"{folder} already exists")

    @staticmethod
    def _items(state_dict: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
        import torch

        if not isinstance(state_dict, Mapping):
            raise SnapshotError(f"a state dict must be a mapping of name -> tensor, got {type(state_dict).__name__}")
        items = []
        for name, t in state_dict.items():
            if not isinstance(name, str) or not name or "#" in name:
                raise SnapshotError(f"tensor names must be non-empty strings without '#', got {name!r}")
            if not isinstance(t, torch.Tensor):
                raise SnapshotError(f"state dict entry {name!r} is a {type(t).__name__}, not a torch.Tensor")
            st_dtype(t)
            items.append((name, t))
        if not items:
            raise SnapshotError("refusing to publish an empty state dict")
        return items

    def _split(self, items: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
        groups: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for key, t in items:
            n = tensor_nbytes(t)
            if groups[-1] and size + n > self.max_file_bytes:
                groups.append([])
                size = 0
            groups[-1].append((key, t))
            size += n
        return groups

    def _write(self, folder: Path, items: list[tuple[str, torch.Tensor]], *, rank: int, world_size: int,
               shards: dict[str, Shard], one_file: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Write ``items`` as files in ``folder``; returns (file entries, tensor index) for the manifest.
        ``one_file``: all in one file of that name (an adapter)."""
        keyed = [(f"{k}#shard{rank}" if k in shards else k, t) for k, t in items]
        groups = [keyed] if one_file else self._split(keyed)
        prefix = "model-" if world_size == 1 else f"model-rank{rank:05d}-"
        single = world_size == 1 and len(groups) == 1  # HF's name for a model in one file
        files: list[dict[str, Any]] = []
        streams: list[int] = []
        # sha256 runs on one thread and fsync on another while the next file is written; all three release the GIL.
        # A small snapshot does both on this thread: starting two threads would cost more than the work.
        small = sum(tensor_nbytes(t) for _, t in items) <= INLINE_BYTES
        with HashPipeline(0 if small else None) as hasher, \
                (_Inline() if small else ThreadPoolExecutor(1, thread_name_prefix="fsync")) as flusher:
            synced = []
            for i, group in enumerate(groups):
                path = folder / ((one_file or "model.safetensors") if single else
                                 f"{prefix}{i + 1:05d}-of-{len(groups):05d}.safetensors")
                tmp = tmp_name(path)
                try:
                    nbytes, stream = write_file(tmp, group, hasher, {"format": "pt"})
                    os.replace(tmp, path)
                except OSError as exc:
                    tmp.unlink(missing_ok=True)
                    raise RunDirError(oserror_message(exc, path)) from exc
                synced.append((path, flusher.submit(fsync_file, path)))
                streams.append(stream)
                files.append({"name": path.name, "bytes": nbytes, "tensors": [k for k, _ in group]})
            for path, done in synced:
                try:
                    done.result()
                except OSError as exc:
                    raise RunDirError(oserror_message(exc, path)) from exc
            digests = hasher.finish()
        for entry, stream in zip(files, streams, strict=True):
            entry["sha256"] = digests[stream]
        file_of = {key: entry["name"] for entry in files for key in entry["tensors"]}
        index: dict[str, Any] = {}
        for (name, t), (key, _) in zip(items, keyed, strict=True):
            piece: dict[str, Any] = {"file": file_of[key], "key": key}
            shape = list(t.shape)
            if name in shards:
                sh = shards[name]
                piece.update(dim=int(sh.dim), offset=int(sh.offset), shape=shape)
                shape = [int(d) for d in sh.full_shape]
            index[name] = {"dtype": st_dtype(t), "shape": shape, "pieces": [piece]}
        return files, index

    def _wait_parts(self, staging: Path, version: int, world_size: int, token: str) -> list[dict[str, Any]]:
        def ready() -> list[dict[str, Any]] | None:
            parts = []
            for r in range(world_size):
                try:
                    p = read_json(_part_meta(staging, r))
                except (FileNotFoundError, ValueError):
                    return None
                if p.get("token") != token or p.get("version") != version or p.get("world_size") != world_size:
                    raise SnapshotError(f"{_part_meta(staging, r)} belongs to another publish "
                                        f"(token {p.get('token')!r}, world_size {p.get('world_size')})")
                parts.append(p)
            return parts

        what = f"all {world_size} ranks' parts of snapshot v{version:06d} in {staging}"
        try:
            return wait_for(ready, what=what, timeout_s=self.part_timeout_s, logger=log)
        except WaitTimeout as exc:
            missing = [r for r in range(world_size) if not _part_meta(staging, r).exists()]
            raise WaitTimeout(f"{exc}; ranks still missing: {missing}") from exc

    @staticmethod
    def _merge(parts: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        files: list[dict[str, Any]] = []
        index: dict[str, Any] = {}
        for part in parts:
            files.extend(part["files"])
            for name, entry in part["tensors"].items():
                if name not in index:
                    index[name] = {**entry, "pieces": list(entry["pieces"])}
                    continue
                have = index[name]
                sharded = "dim" in entry["pieces"][0] and "dim" in have["pieces"][0]
                if not sharded:
                    raise SnapshotError(f"tensor {name!r} is published whole by more than one rank")
                if have["dtype"] != entry["dtype"] or have["shape"] != entry["shape"]:
                    raise SnapshotError(f"tensor {name!r}: ranks disagree on dtype/full shape "
                                        f"({have['dtype']} {have['shape']} vs {entry['dtype']} {entry['shape']})")
                have["pieces"].extend(entry["pieces"])
        for name, entry in index.items():
            check_pieces(name, entry)
        return files, index

    def _manifest(self, version: int, step: int, files: list[dict[str, Any]], tensors: dict[str, Any],
                  world_size: int, model_config: Mapping[str, Any] | None,
                  extra: Mapping[str, Any] | None) -> dict[str, Any]:
        by_dtype: dict[str, int] = {}
        for entry in tensors.values():
            n = 1
            for d in entry["shape"]:
                n *= d
            by_dtype[entry["dtype"]] = by_dtype.get(entry["dtype"], 0) + n
        if model_config is not None and not isinstance(model_config, Mapping) and hasattr(model_config, "to_dict"):
            model_config = model_config.to_dict()
        return {"format": FORMAT, "protocol": PROTOCOL, "version": version, "step": step, "time": time.time(),
                "dtype": max(by_dtype, key=lambda k: by_dtype[k]), "dtypes": sorted(by_dtype),
                "world_size": world_size, "total_bytes": sum(f["bytes"] for f in files), "files": files,
                "tensors": tensors, "model_config": dict(model_config or {}), "extra": dict(extra or {}),
                "writer": {"host": socket.gethostname(), "pid": os.getpid()}}

    def _commit(self, staging: Path, version: int, manifest: dict[str, Any]) -> None:
        final = self.rd.snapshot(version)
        atomic_write_json(staging / MANIFEST, manifest, indent=None)
        atomic_write_text(staging / COMPLETE_MARKER, str(version))
        fsync_dir(staging)
        if final.exists():
            raise SnapshotError(f"cannot publish {final}: it already exists")
        try:
            os.rename(staging, final)
        except OSError as exc:
            raise RunDirError(oserror_message(exc, final)) from exc
        fsync_dir(final.parent)

    def _finish(self, version: int, step: int, manifest: dict[str, Any], t0: float) -> None:
        self._newest = version if self._newest is None else max(self._newest, version)
        current = latest_version(self.rd)
        if current is None or version > current:
            write_latest(self.rd, version, step, manifest["time"])
        seconds = time.monotonic() - t0
        gb = manifest["total_bytes"] / 1e9
        log.info("published snapshot v%06d (step %d, %.2f GB in %.1fs)", version, step, gb, seconds)
        if self.events is not None:
            self.events.event("snapshot_published", f"weights v{version:06d}", step=step, version=version,
                              bytes=manifest["total_bytes"], seconds=round(seconds, 3),
                              gb_per_s=round(gb / max(seconds, 1e-9), 3))
        # Retention and debris removal run beside the caller's next work: deleting gigabytes takes a while, and the
        # snapshot is already visible. The next publish waits for them first.
        self._housekeeping = threading.Thread(target=self._housekeep, name="snapshot-retention", daemon=True)
        self._housekeeping.start()

    def _housekeep(self) -> None:
        try:
            self.apply_retention()
            self.clean_debris()
        except (OSError, SnapshotError) as exc:  # the snapshot is published; housekeeping can wait for next time
            log.warning("snapshot housekeeping in %s failed: %s", self.rd.weights, exc)

    def wait_housekeeping(self, timeout_s: float = 600.0) -> None:
        """Wait until the retention/debris pass started by the last publish is done (each publish calls this)."""
        t = self._housekeeping
        if t is not None:
            t.join(timeout_s)
            if t.is_alive():
                raise WaitTimeout(f"timed out after {timeout_s:.0f}s waiting for snapshot retention in "
                                  f"{self.rd.weights}")
            self._housekeeping = None


HF_INDEX = "model.safetensors.index.json"


def write_hf_files(folder: Path, manifest: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None,
                   *, fsync: bool = False, previous: tuple[Path, list[dict[str, Any]]] | None = None,
                   memo: dict[str, tuple[str, bytes, str]] | None = None,
                   linked: set[str] | None = None) -> list[dict[str, Any]]:
    """Make a snapshot folder an HF model folder: ``config.json`` (the manifest's ``model_config``),
    ``generation_config.json`` (given, or the token ids of the config as ``transformers`` derives it) and, when the
    tensors lie in several files, ``model.safetensors.index.json``. Nothing without a model config, and no index
    when a tensor is sharded over files. Returns their manifest entries (name, bytes, sha256).

    ``previous``: an earlier complete snapshot folder and its entries. A file whose bytes are the same as there (the
    config never changes within a run) is hard-linked from it instead of written: one ``link`` instead of a write, a
    rename and an fsync of its own, on every publish (a demo step publishes every 40 ms). Where linking fails (the
    folder was pruned meanwhile, a filesystem without hard links) the file is written.

    ``memo`` (kept by the caller between calls) holds each file's last content (compact JSON, C encoder) with its
    bytes and sha256, so the same content is not encoded with indentation (Python's encoder) and hashed again.
    ``linked`` collects the names that were linked (durable already: no fsync needed)."""
    import hashlib
    import json

    config = manifest.get("model_config") or {}
    if not config:
        return []
    docs: dict[str, Any] = {"config.json": dict(config)}
    if generation_config is None:
        generation_config = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                             if config.get(k) is not None}
        generation_config["_from_model_config"] = True
    docs["generation_config.json"] = dict(generation_config)
    tensors = manifest["tensors"]
    whole = all(len(e["pieces"]) == 1 and "dim" not in e["pieces"][0] and e["pieces"][0]["key"] == name
                for name, e in tensors.items())
    if whole and len(manifest["files"]) > 1:
        docs[HF_INDEX] = {"metadata": {"total_size": _tensor_bytes(tensors)},
                          "weight_map": {name: e["pieces"][0]["file"] for name, e in sorted(tensors.items())}}
    before = {e["name"]: e["sha256"] for e in previous[1]} if previous is not None else {}
    entries = []
    memo = {} if memo is None else memo
    for name, doc in docs.items():
        key = json.dumps(doc, sort_keys=True)  # the C encoder; the indented form below is Python's (slower)
        known = memo.get(name)
        if known is not None and known[0] == key:
            data, sha = known[1], known[2]
        else:
            data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
            sha = hashlib.sha256(data).hexdigest()
            memo[name] = (key, data, sha)
        if before.get(name) == sha and previous is not None and _link(previous[0] / name, folder / name):
            if linked is not None:
                linked.add(name)
        else:
            atomic_write_bytes(folder / name, data, fsync=fsync)
        entries.append({"name": name, "bytes": len(data), "sha256": sha})
    return entries


def write_adapter_config(folder: Path, config: Mapping[str, Any]) -> dict[str, Any]:
    """``adapter_config.json`` in ``folder`` (PEFT's file, beside ``adapter_model.safetensors``); its manifest
    entry."""
    import hashlib
    import json

    data = (json.dumps(dict(config), indent=2, sort_keys=True) + "\n").encode()
    atomic_write_bytes(folder / ADAPTER_CONFIG, data, fsync=False)
    return {"name": ADAPTER_CONFIG, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _link(src: Path, dst: Path) -> bool:
    """Hard-link ``src`` (a file of a complete snapshot: already durable) as ``dst``; False where that fails."""
    try:
        os.link(src, dst)
    except OSError:
        return False
    return True


def _tensor_bytes(tensors: Mapping[str, Any]) -> int:
    from relax_hpc.weights.format import torch_dtype

    total = 0
    for entry in tensors.values():
        n = 1
        for d in entry["shape"]:
            n *= int(d)
        total += n * torch_dtype(entry["dtype"]).itemsize
    return total


INLINE_BYTES = 4 << 20
"""Snapshots up to this size are hashed and fsynced on the publishing thread (no worker threads)."""


class _Inline:
    """The executor interface of ``ThreadPoolExecutor(1)``, running each call at once on the caller's thread."""

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args))
        except Exception as exc:  # re-raised by .result(), as the pool's future would
            done.set_exception(exc)
        return done

    def __enter__(self) -> _Inline:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


