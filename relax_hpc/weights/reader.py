"""Loading weight snapshots: cheap polling of LATEST, leased and verified loads, in-place updates of a model.

A load reads each file once into one buffer (chunks hashed on a background thread while the next chunk is read),
checks sizes always and sha256 with ``verify="sha256"``, and only then builds tensors, as views of those buffers
(no copy) for whole tensors and by concatenation for tensors published in shards. :meth:`SnapshotReader.load_into`
verifies everything before it writes a single parameter, so a model is either fully updated or left as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from relax_hpc.errors import RunDirError, SnapshotError
from relax_hpc.fsio import is_complete
from relax_hpc.rundir import RunDir
from relax_hpc.weights.delta import apply_delta, base_of
from relax_hpc.weights.format import HashPipeline, parse_file, read_file, torch_dtype
from relax_hpc.weights.manifest import complete_versions, latest_version, read_manifest
from relax_hpc.weights.retention import check_reader_name, drop_lease, take_lease

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Verify = Literal["sha256", "size"]
"""``sha256``: sizes and full-file sha256 against the manifest; ``size``: sizes and safetensors structure only."""


class Snapshot(NamedTuple):
    """A loaded snapshot: unpacks as ``version, state_dict, manifest``."""

    version: int
    state_dict: dict[str, torch.Tensor]
    manifest: dict[str, Any]


def load_snapshot(folder: Path, *, device: str | torch.device = "cpu",
                  verify: Verify = "sha256") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load and verify one complete snapshot folder. FileNotFoundError if a file vanished (deleted meanwhile)."""
    import torch

    if verify not in ("sha256", "size"):
        raise ValueError(f"verify must be 'sha256' or 'size', got {verify!r}")
    device = torch.device(device)
    manifest = read_manifest(folder)
    if base_of(manifest) is not None:  # a delta snapshot: reconstructed from its full base and delta.bin
        return _to_device(_load_delta(folder, manifest, verify), device), manifest
    buffers: dict[str, torch.Tensor] = {}
    streams: dict[str, int] = {}
    with HashPipeline() if verify == "sha256" else contextlib.nullcontext() as hasher:
        for f in manifest["files"]:
            buf, stream = read_file(folder / f["name"], f["bytes"], hasher, pin_memory=device.type == "cuda")
            buffers[f["name"]], streams[f["name"]] = buf, stream
        digests = hasher.finish() if hasher is not None else None
    if digests is not None:
        for f in manifest["files"]:
            got = digests[streams[f["name"]]]
            if got != f["sha256"]:
                raise SnapshotError(f"{folder / f['name']}: sha256 {got} does not match the manifest "
                                    f"({f['sha256']}): corrupt snapshot file")
    _verify_hf_files(folder, manifest, verify)
    in_files = {name: parse_file(folder / name, buf) for name, buf in buffers.items()}
    state: dict[str, torch.Tensor] = {}
    for name, entry in manifest["tensors"].items():
        dtype, shape = torch_dtype(entry["dtype"]), [int(d) for d in entry["shape"]]
        pieces = entry["pieces"]
        parts = []
        for p in pieces:
            t = in_files[p["file"]].get(p["key"])
            if t is None or t.dtype != dtype:
                raise SnapshotError(f"{folder / p['file']}: tensor {p['key']!r} listed in the manifest as "
                                    f"{entry['dtype']} is {'missing' if t is None else t.dtype}")
            parts.append(t)
        if len(pieces) == 1 and "dim" not in pieces[0]:
            full = parts[0]
        else:
            full = torch.empty(shape, dtype=dtype)
            for p, t in zip(pieces, parts, strict=True):
                try:
                    full.narrow(int(p["dim"]), int(p["offset"]), t.shape[int(p["dim"])]).copy_(t)
                except (RuntimeError, IndexError, KeyError, ValueError) as exc:
                    raise SnapshotError(f"{folder / p['file']}: shard {p['key']!r} does not fit {name} "
                                        f"{shape}: {exc}") from exc
        if list(full.shape) != shape:
            raise SnapshotError(f"{folder}: tensor {name!r} has shape {list(full.shape)}, the manifest says {shape}")
        state[name] = full
    return _to_device(state, device), manifest


def _load_delta(folder: Path, manifest: dict[str, Any], verify: Verify) -> dict[str, torch.Tensor]:
    """A delta snapshot's tensors: its full base (a sibling folder) loaded, then the delta applied.
    A missing, incomplete or damaged base is a :class:`SnapshotError` (the reader falls back to an older version).

    The base's files are checked by size only: every reconstructed tensor is checked against its own sha256, which
    a damaged base fails as surely as a damaged delta, so hashing the base too would hash the model twice. Only when
    a tensor fails is the base hashed, to say which of the two is damaged."""
    base_v = base_of(manifest)
    base_dir = folder.parent / f"v{base_v:06d}"
    if not is_complete(base_dir):
        raise SnapshotError(f"{folder}: its base snapshot {base_dir} is missing or incomplete")
    try:
        if base_of(read_manifest(base_dir)) is not None:
            raise SnapshotError(f"{base_dir} is itself a delta")
        base_state, _ = load_snapshot(base_dir, verify="size")
    except FileNotFoundError as exc:
        raise SnapshotError(f"{folder}: its base snapshot {base_dir} vanished ({exc.filename})") from exc
    except SnapshotError as exc:
        raise SnapshotError(f"{folder}: its base snapshot is damaged: {exc}") from exc
    try:
        return apply_delta(folder, manifest, base_state, verify=verify)
    except SnapshotError as exc:
        del base_state
        try:
            load_snapshot(base_dir, verify="sha256")
        except (SnapshotError, FileNotFoundError) as base_exc:
            raise SnapshotError(f"{folder}: its base snapshot is damaged: {base_exc}") from exc
        raise


def _to_device(state: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    import torch

    if device.type != "cpu":
        state = {k: v.to(device, non_blocking=True) for k, v in state.items()}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return state


def _verify_hf_files(folder: Path, manifest: dict[str, Any], verify: Verify) -> None:
    """The HF files beside the manifest (``config.json`` ...): sizes always, sha256 with ``verify: sha256``."""
    import hashlib

    for f in manifest.get("hf_files", []):
        data = (folder / f["name"]).read_bytes()
        if len(data) != f["bytes"]:
            raise SnapshotError(f"{folder / f['name']}: {len(data)} bytes, the manifest says {f['bytes']}: corrupt "
                                "snapshot file")
        if verify == "sha256" and hashlib.sha256(data).hexdigest() != f["sha256"]:
            raise SnapshotError(f"{folder / f['name']}: sha256 does not match the manifest: corrupt snapshot file")


def copy_state_into(target: Any, state: Mapping[str, torch.Tensor], *, strict: bool = True,
                    source: str = "snapshot") -> None:
    """Copy ``state`` into a module's parameters/buffers (or a dict of tensors) in place, after checking all of it."""
    import torch

    dest = target.state_dict() if isinstance(target, torch.nn.Module) else target
    if not isinstance(dest, Mapping):
        raise SnapshotError(f"cannot load {source} into a {type(target).__name__}: need an nn.Module or a dict")
    missing = sorted(set(dest) - set(state))
    unexpected = sorted(set(state) - set(dest))
    if strict and (missing or unexpected):
        raise SnapshotError(f"{source} does not match the model: missing {missing[:5]}{'...' * (len(missing) > 5)},"
                            f" unexpected {unexpected[:5]}{'...' * (len(unexpected) > 5)}")
    pairs = [(k, dest[k], state[k]) for k in dest if k in state]
    for k, d, s in pairs:
        if not isinstance(d, torch.Tensor) or tuple(d.shape) != tuple(s.shape):
            raise SnapshotError(f"{source}: tensor {k!r} has shape {list(s.shape)}, the model has "
                                f"{list(d.shape) if isinstance(d, torch.Tensor) else type(d).__name__}")
    with torch.no_grad():
        for _, d, s in pairs:
            d.copy_(s)


REREAD_S = 1.0
"""SnapshotReader.poll reads LATEST at least this often even when its ``stat`` looks unchanged."""


class SnapshotReader:
    """Polls and loads weight snapshots of one run for one named reader (``rollout-0``), holding a lease meanwhile."""

    def __init__(self, run_dir: RunDir | Path | str, name: str = "rollout-0", *, lease_s: float = 900.0,
                 retries: int = 3):
        self.rd = RunDir.open(run_dir.root if isinstance(run_dir, RunDir) else run_dir)
        self.name = check_reader_name(name)
        self.lease_s = lease_s
        self.retries = retries
        self.loaded_version: int | None = None
        self._latest_stat: tuple[int, int, int] | None = None
        self._latest_seen: int | None = None
        self._latest_read = 0.0  # time.monotonic() of the last read of LATEST
        self._warned_lease = False

    def poll(self) -> int | None:
        """The version LATEST names if it is newer than the last one loaded, else None.

        Costs one ``stat`` of LATEST, plus one small read when the file changed since the previous poll or
        ``REREAD_S`` passed since the last read: a network client's attribute cache may show the old ``stat`` for
        its whole timeout (``actimeo``, sshfs ``attr_timeout``), while opening the file by its name reads the new
        file (close-to-open), so a cached attribute delays a new version by at most ``REREAD_S`` (docs/netfs.md).
        """
        try:
            st = os.stat(self.rd.weights_latest)
        except FileNotFoundError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        now = time.monotonic()
        if key != self._latest_stat or now - self._latest_read >= REREAD_S:
            self._latest_seen = latest_version(self.rd)
            self._latest_stat = key
            self._latest_read = now
        v = self._latest_seen
        return v if v is not None and (self.loaded_version is None or v > self.loaded_version) else None

    def load(self, version: int | None = None, *, device: str | torch.device = "cpu",
             verify: Verify = "sha256") -> Snapshot:
        """Load ``version`` (default: the newest complete one), verified, as a state dict on ``device``.

        Without an explicit version, a snapshot deleted by retention before our lease was seen is retried with the
        newest one (up to ``retries`` times). :class:`SnapshotError` names the file on any verification failure.
        """
        gone = ""
        last_bad: SnapshotError | None = None
        bad: set[int] = set()  # versions that failed verification during this call
        for _ in range(self.retries + 1):
            v = version if version is not None else self._newest(bad)
            if v is None and last_bad is not None:
                raise last_bad  # the newest failed verification and no older complete one is left
            if v is None:
                raise SnapshotError(f"no complete weight snapshot in {self.rd.weights} yet")
            folder = self.rd.snapshot(v)
            self._lease(v)
            try:
                if is_complete(folder):
                    try:
                        state, manifest = load_snapshot(folder, device=device, verify=verify)
                    except FileNotFoundError as exc:
                        gone = f"{exc.filename} vanished"
                    except SnapshotError as exc:  # complete but damaged: fall back to an older verified one
                        if version is not None:
                            raise
                        bad.add(v)
                        log.warning("snapshot %s fails verification (%s); trying an older one", folder, exc)
                        gone, last_bad = str(exc), exc
                    else:
                        self.loaded_version = v
                        return Snapshot(v, state, manifest)
                else:
                    gone = f"{folder} is not complete"
            finally:
                with contextlib.suppress(OSError):
                    drop_lease(self.rd, self.name)
            if version is not None:
                raise SnapshotError(f"cannot load snapshot {folder}: {gone} (missing, deleted or not yet complete)")
            log.info("snapshot %s went away before it could be loaded; retrying with the newest", folder)
        raise SnapshotError(f"snapshots in {self.rd.weights} kept disappearing while loading "
                            f"({self.retries + 1} attempts, last: {gone}); is keep_last too small?")

    def load_into(self, target: Any, version: int | None = None, *, verify: Verify = "sha256",
                  strict: bool = True) -> int:
        """Load a snapshot into ``target`` (an nn.Module or a dict of tensors) in place; returns its version.

        The snapshot is fully read and verified before the first parameter is written, so a failed load leaves the
        model unchanged. Parameters may live on any device; dtypes are converted by ``copy_``.
        """
        snap = self.load(version, device="cpu", verify=verify)
        copy_state_into(target, snap.state_dict, strict=strict, source=str(self.rd.snapshot(snap.version)))
        return snap.version

    def _newest(self, bad: frozenset[int] | set[int] = frozenset()) -> int | None:
        v = latest_version(self.rd)
        if v is not None and v not in bad and is_complete(self.rd.snapshot(v)):
            return v
        versions = [x for x in complete_versions(self.rd) if x not in bad]  # LATEST missing, dangling or bad: scan
        return versions[-1] if versions else None

    def _lease(self, version: int) -> None:
        try:
            take_lease(self.rd, self.name, version, self.lease_s)
        except RunDirError as exc:  # a read-only mount of the run dir can still load; retention may race us
            if not self._warned_lease:
                log.warning("cannot take a snapshot lease (%s); loading without one", exc)
                self._warned_lease = True
