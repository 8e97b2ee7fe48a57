"""The weight transport seam (see :mod:`relax_hpc.weights.transport.base`): ``weights.transport`` picks one
implementation, built by :func:`make_sender` on the trainer ranks and :func:`make_receiver` in rollout workers.

=================  ===================  =========================================================================
kind               where                path
=================  ===================  =========================================================================
``files``          fully_async          snapshot files only
``process_group``  fully_async, ``hf``  trainer rank 0 -> each worker over a process group (:mod:`.process_group`)
``server``         fully_async, server  trainer rank 0 -> each worker's servers (:mod:`.server`)
``memory``         colocate, ``hf``     the engine in the trainer's process, in memory (:mod:`.memory`)
``files``          colocate, server     each version's snapshot files, loaded by the server between steps
                                        (:class:`.files.EngineFilesSender`)
``auto``           any                  colocate: ``memory`` for ``hf``, ``files`` for a server engine;
                                        fully_async: ``process_group`` for ``hf``, else ``files``
=================  ===================  =========================================================================

Deprecated keys, translated with a warning (:func:`resolve`): ``weights.fast_path: off`` -> ``files``, ``auto`` or
``gloo`` -> ``process_group`` with that ``backend``; ``weights.files_every_s`` -> ``process_group``'s
``files_every_s``; ``rollout.server.weight_sync: distributed`` -> ``server``, ``files`` -> ``files``. They only
steer ``auto`` (in colocate they never mattered); set with an explicit ``weights.transport`` they are an error.

This module imports no torch; each implementation imports what it needs when built.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from relax_hpc.config.schema import (
    FilesTransport,
    MemoryTransport,
    ProcessGroupTransport,
    RecipeConfig,
    ServerConfig,
    ServerRolloutBase,
    ServerTransport,
    WeightSyncConfig,
)
from relax_hpc.errors import ConfigError
from relax_hpc.weights.transport.base import WeightReceiver, WeightSender

if TYPE_CHECKING:
    from relax_hpc.events import EventLog
    from relax_hpc.rollout.engine import RolloutEngine
    from relax_hpc.rundir import RunDir
    from relax_hpc.trainer.session import TrainerSession

__all__ = ["WeightReceiver", "WeightSender", "deprecation", "make_receiver", "make_sender", "resolve"]

log = logging.getLogger(__name__)

Transport = FilesTransport | ProcessGroupTransport | ServerTransport | MemoryTransport
SERVER_ENGINES = ("sglang", "vllm")
KINDS_BY_MODE = {"colocate": ("memory", "files"), "fully_async": ("files", "process_group", "server")}
DEPRECATED = (("weights", "fast_path", WeightSyncConfig), ("weights", "files_every_s", WeightSyncConfig),
              ("rollout.server", "weight_sync", ServerConfig))
"""The keys ``weights.transport`` replaces: (section, key, its schema class)."""


def _old_keys(cfg: RecipeConfig) -> list[str]:
    """The deprecated keys the recipe sets to something other than their default (``--set`` included; a run dir's
    ``config.json`` holds every key, so a key at its default counts as not set: it changes nothing)."""
    w = cfg.weights
    given: dict[str, object] = {"weights.fast_path": w.fast_path, "weights.files_every_s": w.files_every_s}
    if isinstance(cfg.rollout, ServerRolloutBase):  # only a server engine has a rollout.server section to speak of
        given["rollout.server.weight_sync"] = cfg.rollout.server.weight_sync
    defaults = {f"{s}.{k}": m.model_fields[k].default for s, k, m in DEPRECATED}
    return [key for key, value in given.items() if value != defaults[key]]


def _translate(cfg: RecipeConfig) -> Transport:
    """``auto`` (and the deprecated keys) -> the transport of this mode and engine."""
    w = cfg.weights
    if cfg.colocated:  # the hf engine lives in the trainer's process; a server loads the files
        server = isinstance(cfg.rollout, ServerRolloutBase)
        return FilesTransport(kind="files") if server else MemoryTransport(kind="memory")
    if isinstance(cfg.rollout, ServerRolloutBase):
        distributed = cfg.rollout.server.weight_sync == "distributed"
        return ServerTransport(kind="server") if distributed else FilesTransport(kind="files")
    if w.fast_path == "off":
        return FilesTransport(kind="files")
    return ProcessGroupTransport(kind="process_group", backend="gloo" if w.fast_path == "gloo" else "auto",
                                 files_every_s=w.files_every_s)


def deprecation(cfg: RecipeConfig) -> str | None:
    """The warning for the deprecated keys ``cfg`` sets beside ``kind: auto`` (None when it sets none)."""
    old = _old_keys(cfg)
    if not old or cfg.weights.transport.kind != "auto":
        return None
    return (f"{', '.join(old)}: deprecated, use weights.transport (this recipe: weights.transport.kind="
            f"{_translate(cfg).kind}); see docs/protocol.md, Weight transport")


def resolve(cfg: RecipeConfig, *, warn: bool = True) -> Transport:
    """The transport ``cfg`` selects: ``weights.transport`` as set, or for ``auto`` the mode's and engine's (the
    deprecated keys translated, with a ``FutureWarning`` unless not ``warn``). Raises :class:`ConfigError` (one
    line) for a transport the mode or engine cannot use, and for a deprecated key beside an explicit transport."""
    t, old = cfg.weights.transport, _old_keys(cfg)
    if t.kind == "auto":
        msg = deprecation(cfg)
        if msg is not None and warn:
            warnings.warn(msg, FutureWarning, stacklevel=2)
            log.warning(msg)
        return _translate(cfg)
    if old:
        raise ConfigError(f"{', '.join(old)}: deprecated and not allowed beside weights.transport.kind={t.kind}; "
                          "drop them")
    _check(cfg, t.kind)
    return t


def _check(cfg: RecipeConfig, kind: str) -> None:
    allowed = KINDS_BY_MODE.get(cfg.mode, ())
    if kind not in allowed:
        raise ConfigError(f"weights.transport.kind={kind}: not a transport of mode {cfg.mode} (use "
                          f"{' or '.join(('auto', *allowed))})")
    server = cfg.rollout.engine in SERVER_ENGINES
    if cfg.colocated and kind == "memory" and server:
        raise ConfigError(f"weights.transport.kind=memory: rollout.engine={cfg.rollout.engine} generates in its own "
                          "server process; in colocate it loads each version's files (use files or auto)")
    if cfg.colocated and kind == "files" and not server:
        raise ConfigError("weights.transport.kind=files: in colocate the hf engine generates with the trainer's own "
                          "weights (use memory or auto)")
    if kind == "process_group" and server:
        raise ConfigError(f"weights.transport.kind=process_group: rollout.engine={cfg.rollout.engine} is a server "
                          "engine; use server or files")
    if kind == "server" and not server:
        raise ConfigError(f"weights.transport.kind=server: rollout.engine={cfg.rollout.engine} has no server; use "
                          "process_group or files")


def make_sender(cfg: RecipeConfig, session: TrainerSession, *, run_dir: RunDir, rank: int, device: str,
                engine: RolloutEngine | None = None, call: Callable[[Coroutine[Any, Any, Any]], Any] | None = None,
                events: EventLog | None = None) -> WeightSender:
    """The trainer side of the recipe's transport (every trainer rank; rank 0 holds the links). ``engine`` and
    ``call`` (run a coroutine on the engine's loop): the colocate engine (``memory``; ``files`` for a server)."""
    from relax_hpc.weights.transport.files import FilesSender, SnapshotFiles

    t = resolve(cfg)
    files = SnapshotFiles(session)
    every, n = cfg.weights.publish_every, cfg.rollout.num_workers
    if isinstance(t, MemoryTransport):
        if engine is None or call is None:
            raise ValueError("weights.transport=memory needs the in-process engine and its loop")
        from relax_hpc.weights.transport.memory import MemorySender

        return MemorySender(files, engine, call, run_dir=run_dir, publish_every=every, events=events)
    if isinstance(t, FilesTransport) and cfg.colocated:  # a server engine in this process
        if engine is None or call is None:
            raise ValueError("weights.transport=files in colocate needs the engine and its loop")
        from relax_hpc.weights.transport.files import EngineFilesSender

        return EngineFilesSender(files, engine, call, run_dir=run_dir, verify=cfg.weights.verify)
    if isinstance(t, FilesTransport):
        return FilesSender(files, publish_every=every)
    from relax_hpc.weights.transport.process_group import LinkSender

    if isinstance(t, ProcessGroupTransport):
        from relax_hpc.weights.transport.process_group import process_group_links

        links = process_group_links(run_dir, n, backend=t.backend, device=device) if rank == 0 else None
        return LinkSender(t.kind, files, links, publish_every=every, files_every_s=t.files_every_s)
    if isinstance(t, ServerTransport):
        from relax_hpc.weights.transport.server import server_links, wired

        if not wired(cfg.rollout.engine) or not isinstance(cfg.rollout, ServerRolloutBase):
            return FilesSender(files, publish_every=every)
        links = server_links(run_dir, cfg, device=device, events=events) if rank == 0 else None
        if rank == 0 and links is None:
            return FilesSender(files, publish_every=every)
        return LinkSender(t.kind, files, links, publish_every=every, files_every_s=0.0)
    raise ConfigError(f"weights.transport: unknown transport {t!r}")


def make_receiver(cfg: RecipeConfig, engine: RolloutEngine, *, run_dir: RunDir, rank: int, proc: str,
                  events: EventLog | None = None) -> WeightReceiver:
    """The rollout worker's side of the recipe's transport (fully_async)."""
    from relax_hpc.rollout.weight_sync import WeightSync
    from relax_hpc.weights.transport.files import SyncReceiver

    t = resolve(cfg)
    fast: Any = None
    if isinstance(t, MemoryTransport):
        raise ConfigError("weights.transport.kind=memory: a colocate transport has no rollout worker")
    if isinstance(t, ProcessGroupTransport):
        template = engine.weight_template()
        if template is not None:
            from relax_hpc.rollout.weight_sync import FastPathStream
            from relax_hpc.weights.fastpath import FastPathClient, link_device

            device = str(next(iter(template.values())).device) if template else "cpu"
            fast = FastPathStream(FastPathClient(run_dir, rank, device=link_device(t.backend, device)), template)
    elif isinstance(t, ServerTransport):
        from relax_hpc.weights.transport.server import wired

        if wired(cfg.rollout.engine) and isinstance(cfg.rollout, ServerRolloutBase):
            from relax_hpc.rollout.server.fastpath import ServerFastPath

            fast = ServerFastPath(run_dir, rank, timeout_s=min(30.0, cfg.rollout.server.sync_timeout_s),
                                  server_ranks=engine.transfer_ranks)
        elif events is not None:
            events.event("weight_sync_files", f"weights.transport=server: the {cfg.rollout.engine} servers' "
                         "weight-transfer engine needs its communicator on the trainer side, which is not wired; "
                         "they load the snapshot files", level="warning")
    elif not isinstance(t, FilesTransport):
        raise ConfigError(f"weights.transport: unknown transport {t!r}")
    sync = WeightSync(run_dir, engine, reader=proc, verify=cfg.weights.verify, fast=fast)
    return SyncReceiver(t.kind, sync, events)
