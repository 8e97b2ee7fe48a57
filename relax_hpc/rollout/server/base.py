"""The server engine base: a :class:`~relax_hpc.rollout.engine.RolloutEngine` that generates with an inference
server process (SGLang, vLLM) over async HTTP. Adapters (:mod:`.sglang`, :mod:`.vllm`) say how to start the server
and how its endpoints are spelled; everything else lives here:

* lifecycle: the server is started on a free port (:mod:`.process`), recorded in the run dir, polled until healthy;
  a server that dies is restarted with backoff (counted in :attr:`ServerEngine.stats`, raised as an alert) and
  reloaded at the newest weights; ``close`` stops it (SIGTERM, SIGKILL after the grace period).
* generation: one HTTP request per sample (``n`` concurrent requests for a prompt), prompt token ids in, token ids
  and per-token log-probs out, never re-tokenized; the HTTP client's connection limit bounds the requests in flight.
  A prefix continues a sample: the server sees prompt + prefix and generates at most ``max_new_tokens - len(prefix)``
  more tokens. Every token carries the version the server held when it was generated.
* pause/abort/resume and the weight sink (files or the distributed fast path with fallback to files).

Log-probs: both adapters return ``log_softmax(logits / temperature)`` of the sampled token (SGLang by default; vLLM
started with ``--logprobs-mode processed_logprobs``), the quantity the trainer recomputes, as long as no top-k/top-p
cut is set: with one, vLLM reports the log-prob renormalised over the kept tokens (it is the sampling distribution,
but not the trainer's), see docs/engines.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relax_hpc.config.schema import ServerConfig
from relax_hpc.errors import RelaxError
from relax_hpc.rollout.engine import (
    BucketStream,
    EngineHealth,
    GenerateRequest,
    GenerateResult,
    Prefix,
    RolloutEngine,
    SampleOutput,
    SamplingParams,
    SnapshotFolder,
    WeightSource,
)
from relax_hpc.rollout.server.process import ServerProcess, ServerSpec, ServerStartError, build_argv, free_port


class ServerError(RelaxError):
    """A server that answered a request with an error (the message carries its reply)."""


class ServerGone(RelaxError):
    """The server process died (or stopped answering) while a request was in flight."""


@dataclass(frozen=True)
class GroupInfo:
    """The process group of the fast path: trainer rank 0 is rank 0, this server's ranks start at ``rank_offset``."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    group_name: str = "relax_weights"
    backend: str = "nccl"
    packed: bool = True
    """vLLM: tensors go packed into ``packed_num_buffers`` buffers of ``packed_buffer_size_bytes`` (vLLM's trainer
    side packs by default; its server side must be told, it defaults to unpacked)."""
    packed_buffer_size_bytes: int = 1 << 30
    packed_num_buffers: int = 2


class DistributedSource(BucketStream):
    """The fast path for servers: the trainer broadcasts each bucket's tensors (in order, src = rank 0) while the
    engine tells its server which tensors to receive. ``buckets()`` yields the metadata as meta tensors."""

    def __init__(self, group: GroupInfo, buckets: Sequence[Sequence[tuple[str, str, Sequence[int]]]]):
        self.group = group
        self.metas = [[(n, d, list(s)) for n, d, s in b] for b in buckets]

    def buckets(self) -> Iterator[dict[str, Any]]:
        import torch

        for bucket in self.metas:
            yield {n: torch.empty(s, dtype=getattr(torch, d), device="meta") for n, d, s in bucket}


@dataclass
class ServerSetup:
    """Everything an adapter needs to start its server (made by :func:`relax_hpc.rollout.server.make_server_engine`)."""

    name: str
    """Names the server's record and log: ``rollout-0-0``."""
    model_dir: Path
    """An HF model folder with the tokenizer (the weights the server starts with)."""
    record: Path
    log: Path
    device: str = "cuda"
    """``cpu`` when the server runs on the CPU (vLLM's CPU build): adapters pick CPU-safe defaults."""
    dtype: str = "float32"
    max_model_len: int = 2048
    seed: int = 0
    eos_token_id: int | None = None
    version: int = 0
    """The version of the weights in ``model_dir``."""
    views: Path | None = None
    """Where HF-loadable views of snapshot folders are made (links + config.json) when a snapshot has no
    config.json; None = next to ``record``."""
    extra_server_args: dict[str, Any] = field(default_factory=dict)
    """Engine-specific server arguments as ``{name: value}`` (``rollout.sglang.server_args``)."""
    newest: Callable[[], tuple[int, SnapshotFolder] | None] | None = None
    """The newest complete snapshot (a restarted server is brought to it); None = the last one received."""
    events: Any = None
    """An :class:`relax_hpc.events.EventLog` for restarts, fallbacks and alerts (optional)."""
    sleep_level: int = 0
    """How deep the server will be put to sleep (``rollout.server.sleep_level`` in colocate; 0 = never): adapters
    start it with what that needs (vLLM ``--enable-sleep-mode`` on a GPU, SGLang ``--enable-memory-saver``)."""
    gpu_memory_utilization: float | None = None
    """The server's share of its GPU's memory (None = the engine's default)."""


@dataclass
class _Call:
    """One HTTP generation request in flight (one sample)."""

    rid: str
    request_id: str
    task: asyncio.Task[Any] | None = None
    preempted: bool = False
    held: bool = False
    """Cut by pause(abort=False): continued after resume with its tokens so far (each keeps its version)."""


@dataclass
class Stats:
    server_starts: int = 0
    server_restarts: int = 0
    startup_s: float = 0.0
    weight_updates: int = 0
    weight_update_s: float = 0.0
    fallbacks: int = 0
    preempted: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    def as_metrics(self, prefix: str = "rollout/server_") -> dict[str, float]:
        out = {f"{prefix}{k}": float(v) for k, v in vars(self).items() if k != "extra"}
        out.update({f"{prefix}{k}": v for k, v in self.extra.items()})
        return out


class ServerEngine(RolloutEngine):
    """Generation with one inference server process per engine (an adapter supplies the endpoints)."""

    kind: str = "server"
    health_path: str = "/health"
    paused_health_path: str | None = None
    """The health endpoint while generation is paused (None = :attr:`health_path`): SGLang's ``/health`` generates a
    token, which waits while paused, so a healthy paused server would look dead."""
    version_path: str | None = None
    """Where the server reports its version (None: not read)."""
    checked_versions: str = ""
    """The server versions this adapter was checked against (a PEP 440 specifier; ``rollout.server.versions``
    overrides it)."""
    batch_n: bool = False
    """The server samples ``n`` completions of one prompt in one request (fresh, non-greedy requests only: a prefix is
    per sample, and vLLM refuses n > 1 for greedy). Aborting that request aborts all its samples."""

    def __init__(self, cfg: ServerConfig, setup: ServerSetup):
        self.cfg = cfg
        self.setup = setup
        self.version = setup.version
        self.stats = Stats()
        self.server: ServerProcess | None = None
        self._client: Any = None
        self._client_loop: Any = None
        self._run_flag = True  # a flag, not an asyncio.Event: callers may drive the engine from several loops
        self._calls: dict[str, _Call] = {}
        self._aborted: set[str] = set()
        self._preempted: set[str] = set()
        self._last_folder: SnapshotFolder | None = None
        self._locks: dict[int, asyncio.Lock] = {}
        self._closed = False
        self._start_dir: Path = setup.model_dir
        """The folder the next server start loads (a restart after a reload-by-restart starts on the snapshot)."""
        self._asleep = 0
        """The level the server sleeps at (0 = awake)."""
        self._weights_awake = True
        """Whether the weights' memory is back (a wake with ``weights_only``, or awake)."""
        self._weights_gone = False
        """A level-2 sleep discarded the weights' contents and no version was received since."""

    # ----------------------------------------------------------------------------------------- adapter hooks
    @abstractmethod
    def server_args(self, model_dir: Path, port: int) -> list[str]:
        """The engine's own server arguments (model, host, port, dtype, ...)."""

    def server_env(self) -> dict[str, str]:
        return dict(self.cfg.env)

    @abstractmethod
    def default_command(self) -> str:
        """The command used when ``rollout.server.command`` is None."""

    @abstractmethod
    async def _post_generate(self, rid: str, ids: list[int], sp: SamplingParams, max_new: int, n: int,
                             media: dict[str, Any] | None = None
                             ) -> list[tuple[list[int], list[float], str, int | None]]:
        """One generation request for ``n`` samples (``n > 1`` only when :attr:`batch_n`): per sample (token ids,
        log-probs, finish reason, weight version the server reports or None). ``media``: the prompt's raw media
        (``ids`` are then the compact prompt ids, see :mod:`.media`)."""

    @abstractmethod
    async def _server_abort(self, rids: list[str] | None) -> None: ...

    @abstractmethod
    async def _server_pause(self, abort: bool) -> None: ...

    @abstractmethod
    async def _server_resume(self) -> None: ...

    @abstractmethod
    async def _load_folder(self, path: Path, version: int) -> None:
        """Load a snapshot folder (the server is paused or idle)."""

    @abstractmethod
    async def _load_distributed(self, source: DistributedSource, version: int) -> None:
        """Receive the trainer's broadcast (the fast path); raise on any failure."""

    async def _server_sleep(self, level: int) -> None:
        """Put the server to sleep at ``level`` (1 or 2); adapters with :attr:`can_sleep` implement it."""
        raise NotImplementedError(f"the {self.kind} engine cannot sleep")

    async def _server_wake(self, part: str) -> None:
        """Take memory back: ``weights``, ``rest`` (everything but the weights) or ``all``."""
        raise NotImplementedError(f"the {self.kind} engine cannot sleep")

    def build_problem(self, argv: list[str], env: dict[str, str]) -> str | None:
        """What makes the server build in ``argv``'s environment unusable here (checked before the first start),
        None when nothing is known to be wrong."""
        return None

    def _on_start(self) -> None:
        """A new server process is up (first start or restart): forget per-server state (its weight-update group)."""

    async def _on_ready(self) -> None:
        """The new server answers (its version checked): read what the engine needs to know of it."""

    def transfer_ranks(self) -> int | None:
        """The ranks the server brings into a weight-transfer group (None: the link's world size stands)."""
        return None

    async def _fast_path_failed(self) -> None:
        """The fast path failed (any error, timeout or transport error): forget and, where the server can, release its
        weight-update group before the files are loaded."""

    def server_version(self, info: Any) -> str | None:
        """The version in the reply of :attr:`version_path`."""
        return str(info.get("version")) if isinstance(info, dict) and info.get("version") else None

    def metrics(self) -> dict[str, float]:
        """``rollout/server_<counter>`` of :class:`Stats` (restarts, starts, weight updates, fallbacks, ...)."""
        return self.stats.as_metrics()

    # ----------------------------------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        assert self.server is not None, "server not started"
        return self.server.url

    @property
    def _restart_lock(self) -> asyncio.Lock:
        """One lock per event loop (engines may be driven by ``asyncio.run`` calls one after another)."""
        loop = asyncio.get_running_loop()
        return self._locks.setdefault(id(loop), asyncio.Lock())

    def _http(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._client is not None and self._client_loop is not loop:
            self._client = None  # its connections belong to a loop that is gone or elsewhere
        if self._client is None:
            self._client_loop = loop
            import logging

            import httpx

            logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise

            limits = httpx.Limits(max_connections=self.cfg.max_connections,
                                  max_keepalive_connections=self.cfg.max_connections)
            self._client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(self.cfg.control_timeout_s),
                                             trust_env=False)
        return self._client

    async def start(self) -> float:
        """Start the server and wait until it is healthy (seconds it took)."""
        port = self.cfg.port if self.cfg.port is not None else free_port(self.cfg.host)
        s = self.setup
        argv = build_argv(self.cfg.command or self.default_command(), self.server_args(self._start_dir, port),
                          self.cfg.extra_args)
        spec = ServerSpec(name=s.name, argv=argv, host=self.cfg.host, port=port, health_path=self.health_path,
                          log=s.log, record=s.record, env=self.server_env(),
                          startup_timeout_s=self.cfg.startup_timeout_s, stop_grace_s=self.cfg.stop_grace_s)
        self.server = ServerProcess(spec)
        if self.stats.server_starts == 0:  # the first start: a server build that cannot run here is refused now
            problem = await asyncio.to_thread(self.build_problem, argv, {**os.environ, **spec.env})
            if problem is not None:
                raise self.server.refuse(problem)
        self.server.start()
        took = await self.server.wait_ready(self._http())
        self._asleep, self._weights_awake, self._weights_gone = 0, True, False  # a new server is awake
        self._on_start()
        version = await self._check_version()
        await self._on_ready()
        self.stats.server_starts += 1
        self.stats.startup_s = took
        name = f"{self.kind} {version} server" if version else f"{self.kind} server"
        self._event("server_ready", f"{name} {s.name} ready on {self.server.url} after {took:.1f} s",
                    startup_s=round(took, 2), pid=self.server.proc.pid if self.server.proc else None,
                    server_version=version)
        return took

    async def _check_version(self) -> str | None:
        """Read the server's version, log it, and refuse (one line, the server stopped) one outside
        ``rollout.server.versions`` (default: :attr:`checked_versions`)."""
        if self.version_path is None or self.server is None:
            return None
        import logging

        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion, Version

        try:
            version = self.server_version(await self._json("GET", self.version_path))
        except (ServerError, ServerGone) as exc:
            await asyncio.to_thread(self.server.stop)
            raise ServerStartError(f"inference server {self.setup.name}: cannot read its version from "
                                   f"{self.version_path} ({str(exc).splitlines()[0]})") from None
        wanted = self.checked_versions if self.cfg.versions is None else self.cfg.versions
        logging.getLogger(__name__).info("%s server %s: version %s (accepted: %s)", self.kind, self.setup.name,
                                         version, wanted or "any")
        try:
            ok = not wanted or (version is not None and SpecifierSet(wanted).contains(Version(version),
                                                                                        prereleases=True))
        except (InvalidSpecifier, InvalidVersion):
            ok = False
        if not ok:
            await asyncio.to_thread(self.server.stop)
            raise ServerStartError(f"inference server {self.setup.name}: {self.kind} {version} is outside the "
                                   f"versions this engine was checked against ({wanted}; rollout.server.versions)")
        return version

    async def ensure_started(self) -> None:
        """Start the server at first use (engines are built synchronously; the server starts in the event loop)."""
        if self.server is None:
            async with self._restart_lock:
                if self.server is None:
                    await self.start()

    async def close(self) -> None:
        self._closed = True
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        if self._client is not None:
            if self._client_loop is asyncio.get_running_loop():
                await self._client.aclose()
            self._client = None  # a client of another (closed) loop has no connections to close here

    async def health(self) -> EngineHealth:
        if self.server is None or not self.server.alive():
            return EngineHealth(ok=False, version=self.version, detail="server not running")
        running = self._run_flag and not self._asleep
        path = self.health_path if running else (self.paused_health_path or self.health_path)
        try:
            r = await self._http().get(self.url + path, timeout=10.0)
            ok = r.status_code == 200
            return EngineHealth(ok=ok, version=self.version, detail="" if ok else f"HTTP {r.status_code}")
        except Exception as exc:
            return EngineHealth(ok=False, version=self.version, detail=f"{type(exc).__name__}: {exc}")

    async def _recover(self) -> None:
        """The server died: restart it with backoff, bring it to the newest weights. Concurrent callers wait for
        the one restart."""
        async with self._restart_lock:
            if (self.server is not None and self.server.alive()) or self._closed:
                return
            if self.stats.server_restarts >= self.cfg.max_restarts:
                raise ServerStartError(f"inference server {self.setup.name} died and was restarted "
                                       f"{self.stats.server_restarts} times (rollout.server.max_restarts); "
                                       f"server log: {self.setup.log}")
            code = self.server.proc.returncode if self.server and self.server.proc else None
            delay = self.cfg.restart_backoff_s * (2 ** self.stats.server_restarts)
            self.stats.server_restarts += 1
            self._alert("server_died", f"{self.kind} server {self.setup.name} exited (code {code}); restart "
                        f"{self.stats.server_restarts} in {delay:.1f} s (log: {self.setup.log})")
            if self.server is not None:
                await asyncio.to_thread(self.server.stop, 1.0)
            await asyncio.sleep(delay)
            await self.start()
            await self._catch_up()

    async def _catch_up(self) -> None:
        newest = self.setup.newest() if self.setup.newest else None
        if newest is None and self._last_folder is not None:
            newest = (self.version, self._last_folder)
        if newest is None:
            self.version = self.setup.version
            return
        folder = await asyncio.to_thread(self._loadable, Path(newest[1].path))
        if folder != self._start_dir and (newest[0] != self.setup.version or self._last_folder is not None):
            await self._load_folder(folder, newest[0])
            self._event("server_caught_up", f"restarted server loaded version {newest[0]}", version=newest[0])
        self.version = newest[0]

    # ----------------------------------------------------------------------------------------- generation
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        sp = request.sampling
        prefixes = request.prefixes or [None] * sp.n
        if len(prefixes) != sp.n:
            raise ValueError(f"request {request.request_id}: {len(prefixes)} prefixes for n={sp.n}")
        if self._asleep:
            raise ServerError(f"{self.kind} server {self.setup.name} is asleep (level {self._asleep}): wake() it "
                              "before generating")
        await self.ensure_started()
        if self.batch_n and request.prefixes is None and sp.n > 1 and sp.temperature > 0:  # one request, n samples
            ids = _server_prompt(request)
            got = await self._call(request.request_id, request.request_id, ids, sp, sp.max_new_tokens, sp.n, hold=True,
                                   media=request.media)
            samples = [o for o, _ in got]
            if any(held and o.finish_reason == "abort" for o, held in got):  # held: continue each as a prefix
                from relax_hpc.rollout.server.partial import as_prefix

                rest = await asyncio.gather(*(self._sample(request, j, as_prefix(o)) for j, o in enumerate(samples)))
                samples = [_concat(o, r) for o, r in zip(samples, rest, strict=True)]
        else:
            samples = await asyncio.gather(*(self._sample(request, j, prefixes[j]) for j in range(sp.n)))
        self._aborted.discard(request.request_id)
        return GenerateResult(request_id=request.request_id, samples=list(samples))

    async def _sample(self, request: GenerateRequest, j: int, prefix: Prefix | None) -> SampleOutput:
        sp = request.sampling
        done = 0 if prefix is None else len(prefix.token_ids)
        if sp.max_new_tokens - done <= 0:
            return _empty("length")
        ids = _server_prompt(request) + ([] if prefix is None else [int(t) for t in prefix.token_ids])
        if sp.seed is not None:
            sp = SamplingParams(**{**vars(sp), "seed": sp.seed + j})
        out = _empty("length")
        k = 0
        while True:  # a held call comes back cut: continue it after the resume, its tokens keeping their versions
            left = sp.max_new_tokens - done - len(out.token_ids)
            ((got, held),) = await self._call(request.request_id, f"{request.request_id}.{j}.{k}",
                                              ids + out.token_ids.tolist(), sp, left, 1, hold=True,
                                              media=request.media)
            out = _concat(out, got)
            if not held or got.finish_reason != "abort" or len(out.token_ids) >= sp.max_new_tokens - done:
                return out
            k += 1

    async def _call(self, request_id: str, rid: str, ids: list[int], sp: SamplingParams, max_new: int, n: int,
                    hold: bool = False, media: dict[str, Any] | None = None) -> list[Any]:
        """One server request for ``n`` samples, retried on a restarted server if the server died meanwhile."""
        for attempt in range(self.cfg.max_restarts + 2):
            if request_id in self._aborted:
                cut = [_empty("abort") for _ in range(n)]
                return [(o, False) for o in cut] if hold else cut
            await self._wait_running()
            call = _Call(rid=f"{rid}.{attempt}", request_id=request_id)
            self._calls[call.rid] = call
            version = self.version
            t0 = time.perf_counter()
            try:
                outs = await self._post_generate(call.rid, ids, sp, max_new, n, media)
            except ServerGone:
                await self._recover()
                continue
            finally:
                self._calls.pop(call.rid, None)
            if call.preempted:
                self._preempted.add(request_id)
            dt = time.perf_counter() - t0
            outs = [SampleOutput(token_ids=np.asarray(toks, dtype=np.int32), logprobs=np.asarray(lps, np.float32),
                                 versions=np.full(len(toks), version if served is None else served, dtype=np.int32),
                                 finish_reason=reason, timings={"generate": dt})  # type: ignore[arg-type]
                    for toks, lps, reason, served in outs]
            return [(o, call.held) for o in outs] if hold else outs
        raise ServerStartError(f"inference server {self.setup.name} kept failing requests (log: {self.setup.log})")

    async def _wait_running(self) -> None:
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while not self._run_flag:
            if time.monotonic() > deadline:
                raise ServerError(f"engine paused for more than {self.cfg.request_timeout_s:.0f} s "
                                  "(rollout.server.request_timeout_s)")
            await asyncio.sleep(0.01)

    def was_preempted(self, request_id: str) -> bool:
        """Whether a request's aborted samples were cut by a pause (a weight update), not by :meth:`abort`; the
        partial-rollout helper (:func:`relax_hpc.rollout.server.partial.generate_resumable`) resubmits those."""
        return request_id in self._preempted

    def forget(self, request_id: str) -> None:
        self._preempted.discard(request_id)

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        if request_ids is None:
            names = list(self._calls)
            self._aborted.update(c.request_id for c in self._calls.values())
        else:
            wanted = set(request_ids)
            self._aborted.update(wanted)
            names = [r for r, c in self._calls.items() if c.request_id in wanted]
        if names:
            await self._server_abort(names)

    async def pause(self, *, abort: bool = True) -> None:
        await self.ensure_started()
        self._run_flag = False
        for c in self._calls.values():
            c.preempted, c.held = abort, not abort
        if abort:
            self.stats.preempted += len(self._calls)
        # holding = cut on the server too (its version would not follow the tokens); the engine continues them
        await self._control(lambda: self._server_pause(True))

    async def resume(self) -> None:
        await self.ensure_started()
        await self._control(self._server_resume)
        self._run_flag = True

    async def _control(self, op: Callable[[], Awaitable[Any]]) -> Any:
        """A control call (pause, resume, a weight load). A server that died meanwhile is restarted first (backoff,
        newest weights, as for a generation request) and the call made once more: a SIGKILL that lands during a
        weight update must not end the rollout worker."""
        try:
            return await op()
        except ServerGone:
            proc = self.server.proc if self.server is not None else None
            if proc is not None:  # its connections can break a moment before the process is gone
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(proc.wait, 5.0)
            await self._recover()  # raises its alert (server_died), or ServerStartError past max_restarts
            return await op()

    async def drain(self, timeout_s: float | None = None) -> None:
        """Stop starting new requests and wait until those in flight have finished (the no-partial-rollout way
        to take a weight update); :meth:`resume` undoes it."""
        self._run_flag = False
        deadline = time.monotonic() + (timeout_s or self.cfg.request_timeout_s)
        while self._calls:
            if time.monotonic() > deadline:
                raise ServerError(f"{len(self._calls)} requests still in flight after draining "
                                  f"{timeout_s or self.cfg.request_timeout_s:.0f} s")
            await asyncio.sleep(0.02)

    # ----------------------------------------------------------------------------------------- sleep
    async def sleep(self, level: int) -> None:
        """The server frees its memory (see :meth:`RolloutEngine.sleep`); nothing may be in flight."""
        if not self.can_sleep:
            raise NotImplementedError(f"the {self.kind} engine cannot sleep")
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}: 1 (weights kept in host memory) or 2 (weights discarded)")
        await self.ensure_started()
        if self._asleep:
            return
        if self._calls:
            raise ServerError(f"{self.kind} server {self.setup.name}: cannot sleep with {len(self._calls)} requests "
                              "in flight")
        await self._control(lambda: self._sleep_op(level))
        self.stats.extra["sleeps"] = self.stats.extra.get("sleeps", 0.0) + 1

    async def _sleep_op(self, level: int) -> None:
        await self._server_sleep(level)
        self._asleep, self._weights_awake, self._weights_gone = level, False, level == 2

    async def wake(self, *, weights_only: bool = False) -> None:
        """Take the memory back (see :meth:`RolloutEngine.wake`); after a level-2 sleep a version must be received
        between ``wake(weights_only=True)`` and ``wake()``. A server restarted meanwhile is awake: nothing to do."""
        if not self._asleep or (weights_only and self._weights_awake):
            return
        if not weights_only and self._weights_gone:
            raise ServerError(f"{self.kind} server {self.setup.name}: the level-2 sleep discarded its weights; "
                              "receive a version between wake(weights_only=True) and wake()")
        part = "weights" if weights_only else ("rest" if self._weights_awake else "all")
        await self._control(lambda: self._wake_op(part, weights_only))

    async def _wake_op(self, part: str, weights_only: bool) -> None:
        if not self._asleep:  # restarted by _control: a new server is awake
            return
        await self._server_wake(part)
        self._weights_awake = True
        if not weights_only:
            self._asleep = 0

    # ----------------------------------------------------------------------------------------- weights
    async def receive(self, version: int, source: WeightSource) -> None:
        await self.ensure_started()
        if self._asleep and not self._weights_awake:
            raise ServerError(f"{self.kind} server {self.setup.name} is asleep: wake(weights_only=True) before "
                              "receiving weights")
        t0 = time.perf_counter()
        if isinstance(source, SnapshotFolder):
            await self._receive_folder(version, source)
        elif isinstance(source, DistributedSource):
            await self._receive_distributed(version, source)
        elif isinstance(source, BucketStream):  # tensors in this process: hand them over as a folder
            folder = await asyncio.to_thread(self._bucket_folder, version, source)
            await self._receive_folder(version, SnapshotFolder(folder, verify="none"))
        else:
            raise TypeError(f"{self.kind} engine: unsupported weight source {type(source).__name__} "
                            "(a server loads a SnapshotFolder or a DistributedSource)")
        self.version = version
        self._weights_gone = False
        self.stats.weight_updates += 1
        self.stats.weight_update_s = time.perf_counter() - t0

    async def _receive_folder(self, version: int, source: SnapshotFolder) -> None:
        if source.verify != "none":
            await asyncio.to_thread(_verify_folder, Path(source.path), source.verify)
        folder = await asyncio.to_thread(self._loadable, Path(source.path))
        await self._control(lambda: asyncio.wait_for(self._load_folder(folder, version),
                                                    timeout=self.cfg.sync_timeout_s))
        self._last_folder = SnapshotFolder(folder, verify="none")

    def _bucket_folder(self, version: int, source: BucketStream) -> Path:
        """Write a bucket stream's tensors as an HF folder (safetensors + the start folder's config) for the server."""
        import shutil

        from safetensors.torch import save_file

        root = self.setup.views or self.setup.record.parent / self.setup.name / "views"
        folder = root / f"buckets-v{version:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {}
        for bucket in source.buckets():
            state.update({k: v.detach().to("cpu").contiguous().clone() for k, v in bucket.items()})
        save_file(state, str(folder / "model.safetensors"))
        shutil.copy2(self.setup.model_dir / "config.json", folder / "config.json")
        return folder

    def _loadable(self, folder: Path) -> Path:
        """``folder`` if a server can load it as the model it serves (a config.json naming the architecture), else a
        view of it: links to its files plus a config (the folder's, else the manifest's model_config, else the start
        folder's) with the start folder's ``architectures`` where it names none; older views go. A delta snapshot is
        materialised into a full folder first (:func:`relax_hpc.weights.materialise.full_folder`).

        A trainer that built its model from a config (the tiny model) writes a config.json without
        ``architectures``; vLLM then resolves ``model_type: qwen3`` to the base ``Qwen3Model``, serves it as an
        embedding model and has no ``/v1/completions`` route (HTTP 404 after a restart on the snapshot)."""
        import json
        import shutil

        from relax_hpc.weights.materialise import full_folder

        root = self.setup.views or self.setup.record.parent / self.setup.name / "views"
        folder = full_folder(folder, root.with_name(root.name + "-full"))  # a delta version: materialised first
        conf = _read_json(folder / "config.json")
        if conf.get("architectures"):
            return folder
        view = root / folder.name
        if not (view / "config.json").exists():
            view.mkdir(parents=True, exist_ok=True)
            for f in folder.iterdir():
                if f.suffix == ".safetensors" and not (view / f.name).exists():
                    (view / f.name).symlink_to(f.resolve())
            start = _read_json(self.setup.model_dir / "config.json")
            conf = conf or _read_json(folder / "manifest.json").get("model_config") or start
            if not conf.get("architectures") and start.get("architectures"):
                conf = {**conf, "architectures": start["architectures"]}
            (view / "config.json").write_text(json.dumps(conf, indent=1))
            for name in ("generation_config.json",):
                src = folder / name if (folder / name).exists() else self.setup.model_dir / name
                if src.exists():
                    shutil.copy2(src, view / name)
        for old in sorted(p for p in root.iterdir() if p.name != view.name)[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        return view

    async def _receive_distributed(self, version: int, source: DistributedSource) -> None:
        try:
            await asyncio.wait_for(self._load_distributed(source, version), timeout=self.cfg.sync_timeout_s)
        except Exception as exc:
            self.stats.fallbacks += 1
            await self._fast_path_failed()
            newest = await self._snapshot_of(version)
            msg = f"fast path to {self.setup.name} failed for version {version} ({type(exc).__name__}: {exc})"
            if newest is None or newest[0] < version:
                self._alert("weight_sync_failed", msg + "; no snapshot of that version on disk")
                raise
            self._event("weight_sync_fallback", msg + f"; loading snapshot v{newest[0]} from the files",
                        version=newest[0], level="warning")
            if not (await self.health()).ok:  # a failed transfer can take the server down: restart it first
                await self._wait_dead(10.0)
                await self._recover()
            await self._receive_folder(newest[0], newest[1])

    async def _snapshot_of(self, version: int) -> tuple[int, SnapshotFolder] | None:
        """The newest complete snapshot once it is at least ``version`` (the trainer writes a version's files a
        moment after its broadcast), waiting at most ``sync_timeout_s``; else the newest there is."""
        deadline = time.monotonic() + self.cfg.sync_timeout_s
        while True:
            newest = self.setup.newest() if self.setup.newest else None
            if (newest is not None and newest[0] >= version) or time.monotonic() > deadline or not self.setup.newest:
                return newest
            await asyncio.sleep(0.1)

    async def _wait_dead(self, timeout_s: float) -> None:
        """Give a server that stopped answering a moment to exit, then stop it (so a restart follows)."""
        deadline = time.monotonic() + timeout_s
        while self.server is not None and self.server.alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if self.server is not None and self.server.alive():
            await asyncio.to_thread(self.server.stop)

    # ----------------------------------------------------------------------------------------- events
    def _event(self, event: str, message: str, level: str = "info", **fields: Any) -> None:
        ev = self.setup.events
        if ev is not None:
            ev.event(event, message, level=level, **fields)

    def _alert(self, event: str, message: str) -> None:
        ev = self.setup.events
        if ev is not None:
            ev.alert(event, message)

    async def _json(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> Any:
        """A control request; transport errors with a dead server raise :class:`ServerGone`."""
        try:
            r = await self._http().request(method, self.url + path, timeout=timeout or self.cfg.control_timeout_s,
                                           **kw)
        except Exception as exc:
            import httpx

            if isinstance(exc, httpx.TransportError):
                raise ServerGone(f"{self.kind} server {self.setup.name}: {type(exc).__name__} on {path}") from exc
            raise
        if r.status_code != 200:
            raise ServerError(f"{self.kind} server {self.setup.name}: {method} {path} -> HTTP {r.status_code}: "
                              f"{r.text[:500]}")
        with contextlib.suppress(ValueError):
            return r.json()
        return None


def _verify_folder(folder: Path, verify: str) -> None:
    """Check a snapshot folder against its manifest before a server reads it (sizes; sha256 reads every file)."""
    from relax_hpc.errors import SnapshotError
    from relax_hpc.weights.manifest import read_manifest

    if not (folder / "manifest.json").exists():
        if (folder / "config.json").exists():
            return  # a plain HF folder (an exported model): nothing to check against
        raise SnapshotError(f"{folder}: not a snapshot folder (no manifest.json, no config.json)")
    if verify == "sha256":
        from relax_hpc.weights.reader import load_snapshot

        load_snapshot(folder, verify="sha256")
        return
    for f in read_manifest(folder)["files"]:
        size = (folder / f["name"]).stat().st_size
        if size != f["bytes"]:
            raise SnapshotError(f"{folder / f['name']}: {size} bytes, the manifest says {f['bytes']}")


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's content; {} when it is missing or not an object."""
    import json

    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def _server_prompt(request: GenerateRequest) -> list[int]:
    """The prompt ids a server gets: the compact ones beside media (the server expands the placeholders)."""
    ids = request.engine_prompt_ids if request.media and request.engine_prompt_ids is not None else request.prompt_ids
    return [int(t) for t in ids]


def _concat(a: SampleOutput, b: SampleOutput) -> SampleOutput:
    """``a``'s tokens then ``b``'s, each keeping its version; ``b``'s finish reason."""
    return SampleOutput(token_ids=np.concatenate([a.token_ids, b.token_ids]).astype(np.int32),
                        logprobs=np.concatenate([a.logprobs, b.logprobs]).astype(np.float32),
                        versions=np.concatenate([a.versions, b.versions]).astype(np.int32),
                        finish_reason=b.finish_reason,
                        timings={"generate": a.timings.get("generate", 0.0) + b.timings.get("generate", 0.0)})


def _empty(reason: str) -> SampleOutput:
    return SampleOutput(token_ids=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32),
                        versions=np.zeros(0, np.int32), finish_reason=reason)  # type: ignore[arg-type]
