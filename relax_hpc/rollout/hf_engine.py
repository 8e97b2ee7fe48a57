"""The ``hf`` engine: a HF model in-process, an adapter of the async :class:`~relax_hpc.rollout.engine.RolloutEngine`.

One thread owns the model. ``generate`` coroutines queue their request and await a future; the thread takes up to
``batch_prompts`` queued prompts with the same sampling settings and generates them together. An engine on the
trainer's own module (colocate, where generation and training strictly alternate) has no thread: its batches run
on the event loop's thread right after the coroutines that queued them (``threaded=False``), so a colocate step hands
nothing between threads. Text prompts to a
plain causal LM go through :mod:`relax_hpc.rollout.decode` (a sampling loop with a KV cache, 1.3x as fast as
``generate`` on the demo model: ``relax-hpc bench generate``); multimodal prompts, stop strings, sharded (FSDP)
weights and ``rollout.hf_decoder: generate`` use ``transformers.generate``. Both check the engine every
:attr:`HFEngine.check_every` tokens: aborted requests end there with the tokens they have, a pause without abort
holds the batch (weights may be received meanwhile: later tokens carry the new version).

Sampling is reproducible: each batch draws a seed from the engine's generator (seeded with ``seed``), or uses the
request's own ``sampling.seed`` (such a request is batched alone). Requests queued together by one
:func:`asyncio.gather` are batched in submission order.

An engine with a thread of its own and ``slots > 0`` (:func:`from_config` gives an engine that loads its own model,
a fully_async worker's, ``batch_prompts x n_samples``) decodes text prompts to a Llama-style model in a
:class:`~relax_hpc.rollout.slots.SlotPool` instead: a fixed pool of decode rows over a static KV cache where a row
that ends hands its slot to the next queued sample between two runs of ``check_every`` decode steps, so the decode
steps stay full while requests keep arriving. Each row keeps its own settings, and its draws depend only on its
request's seed (the request's own, or one drawn from the engine's generator when the request is admitted) and its
sample index: a request decoded beside others gives the tokens it gives alone. Aborted rows end at the next check
with their tokens; a pause without abort holds the pool (weights received meanwhile: the next tokens carry the new
version). Multimodal prompts and stop strings still go to static batches, run between two runs of the pool.
:meth:`HFEngine.metrics` reports the decode-step occupancy of either path.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_hpc.config.schema import LoraConfig, SamplingConfig
from relax_hpc.rollout.engine import (
    BucketStream,
    EngineHealth,
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    SampleOutput,
    SamplingParams,
    SharedModule,
    SnapshotFolder,
    WeightSource,
)

log = logging.getLogger(__name__)


def sampling_params(s: SamplingConfig, n: int = 1) -> SamplingParams:
    """A recipe's ``rollout.sampling`` as per-request settings."""
    return SamplingParams(n=n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          max_new_tokens=s.max_new_tokens, stop=tuple(s.stop))


@dataclass
class _Job:
    """One request in flight."""

    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerateResult]
    outputs: list[SampleOutput | None]
    open_units: int = 0
    aborted: bool = False


@dataclass
class _Unit:
    """A context (prompt, or prompt + prefix) generated ``n`` times: samples ``samples`` of its job."""

    job: _Job
    context: list[int]
    n: int
    samples: list[int]
    budget: int
    pooled: bool = False
    """Decoded in the engine's slot pool (else in a static batch)."""
    admitted: int = 0
    """Pooled: samples placed in slots so far (in order)."""
    seed: int | None = None
    """Pooled: the unit's sampling seed (the request's, or drawn from the engine's generator at admission)."""
    started: float = 0.0
    outs: dict[int, SampleOutput] = field(default_factory=dict)
    """Pooled: the samples that ended, by index in ``samples``."""

    def key(self) -> tuple[Any, ...]:
        s = self.job.request.sampling
        alone = self.job.request.multimodal is not None or s.seed is not None
        return (s.temperature, s.top_p, s.top_k, s.stop, s.stop_token_ids, self.n, id(self.job) if alone else None)


@dataclass
class _Batch:
    """The running batch, as the decode loop's :class:`~relax_hpc.rollout.decode.DecodeControl` sees it."""

    engine: HFEngine
    units: list[_Unit]
    every: int
    rows: list[_Unit] = field(default_factory=list)
    stopped_at: dict[int, int] = field(default_factory=dict)
    """Row -> tokens it had when its request was aborted."""
    ended: set[int] = field(default_factory=set)
    """Rows stopped because they reached their own budget (units of one batch may have different budgets)."""
    versions: list[tuple[int, int]] = field(default_factory=list)
    """(first token index, version) from which tokens were generated with that version."""

    def __post_init__(self) -> None:
        self.rows = [u for u in self.units for _ in range(u.n)]
        self.versions = [(0, self.engine.version)]
        self.budget = max(u.budget for u in self.units)
        self.ragged = any(u.budget < self.budget for u in self.units)

    def held(self) -> bool:
        """Rows not aborted wait here while the engine is paused without abort."""
        return any(not u.job.aborted for u in self.units)

    def check(self, generated: int) -> list[int]:
        self.engine._service(hold=self)
        if self.versions[-1][1] != self.engine.version:
            self.versions.append((generated, self.engine.version))
        out: list[int] = []
        if self.ragged:
            out = [r for r, u in enumerate(self.rows) if u.budget <= generated and r not in self.ended]
            self.ended.update(out)
        if any(u.job.aborted for u in self.units):
            new = [r for r, u in enumerate(self.rows)
                   if u.job.aborted and r not in self.stopped_at and r not in self.ended]
            for r in new:
                self.stopped_at[r] = generated
            out += new
        return out

    def token_versions(self, length: int) -> np.ndarray:
        out = np.empty(length, dtype=np.int32)
        for start, v in self.versions:
            out[start:] = v
        return out


class HFEngine(RolloutEngine):
    """Generate with a HF causal LM in this process. In ``colocate`` the model object is the trainer's own."""

    check_every = 4
    """Tokens between two checks of the engine (abort, pause, received weights) inside a running batch."""

    def __init__(self, model: Any, tokenizer: Any, sampling: SamplingConfig | None = None, *, device: str = "cpu",
                 batch_prompts: int = 16, seed: int = 0, decoder: str = "auto", shared: bool = False,
                 threads: int | None = None, threaded: bool = True, slots: int = 0, slot_length: int = 0,
                 lora: LoraConfig | None = None):
        import torch

        from relax_hpc.rollout.slots import Occupancy

        self.model = model
        self.tokenizer = tokenizer
        self.sampling = sampling_params(sampling or SamplingConfig())
        self.device = device
        self.batch_prompts = batch_prompts
        self.version = 0
        self.shared = shared
        """The module is the trainer's (colocate): :class:`SharedModule` is a valid weight source."""
        self.merger: Any = None
        """``model.lora`` on a module of its own: adapter versions merged into a copy of the base weights
        (:class:`~relax_hpc.models.lora.AdapterMerger`; docs/lora.md says why merged rather than PEFT modules)."""
        self.lora = lora
        if lora is not None and not shared:
            from relax_hpc.models.lora import AdapterMerger

            self.merger = AdapterMerger(model, lora.alpha / lora.rank)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self._loop: bool | None = None if decoder in ("auto", "compiled") else False  # decided at the first batch
        self.compile_decode = decoder == "compiled"
        """The CUDA-graph decode loop runs its layers' elementwise work compiled (``rollout.hf_decoder``)."""
        self._rng = np.random.default_rng(seed)
        self._cond = threading.Condition()
        self._incoming: list[_Unit] = []
        self._ready: list[_Unit] = []
        self._jobs: dict[str, _Job] = {}
        self._commands: list[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any]]] = []
        self._paused = False
        self._closed = False
        self._error: BaseException | None = None
        self._threads = threads or torch.get_num_threads()  # torch CPU threads of the engine's thread
        self.threaded = threaded
        self.slots = slots if threaded and decoder != "generate" and _poolable(model) else 0
        """Rows of the slot pool (0: static batches only); a pool needs the engine's own thread and a model the
        layer-by-layer decoders compute (:func:`relax_hpc.rollout.graph_decode.supported`)."""
        self.slot_length = slot_length
        """Cache columns the pool starts with (prompt + response; grows when a request needs more)."""
        self._pool: Any = None
        self.occupancy = Occupancy()
        """Decode-step occupancy of the static batches and the pool (:meth:`metrics`)."""
        """False: no thread of its own; queued batches run on the event loop's thread, right after the coroutines
        that queued them (colocate: generation and training strictly alternate, so a thread only adds hand-overs).
        Nothing can reach the engine while such a batch runs, so aborts and pauses act between batches."""
        self._thread: threading.Thread | None = None
        if threaded:
            target = self._run_pool if self.slots else self._run
            self._thread = threading.Thread(target=target, name="hf-engine", daemon=True)
            self._thread.start()

    @property
    def uses_loop(self) -> bool:
        """Whether batches run in the engine's own decode loop (decided at the first batch; False before it)."""
        return bool(self._loop)

    # ------------------------------------------------------------------------------------------ the protocol
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        s = request.sampling
        if s.n < 1 or s.max_new_tokens < 1:
            raise ValueError(f"request {request.request_id}: n and max_new_tokens must be >= 1")
        if request.prefixes is not None and len(request.prefixes) != s.n:
            raise ValueError(f"request {request.request_id}: {len(request.prefixes)} prefixes for n={s.n}")
        loop = asyncio.get_running_loop()
        job = _Job(request, loop, loop.create_future(), [None] * s.n)
        units = self._units(job)
        with self._cond:
            self._check_open()
            if request.request_id in self._jobs:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            self._jobs[request.request_id] = job
            job.open_units = len(units)
            self._incoming.extend(units)
        if units:
            loop.call_soon(self._kick)  # after every coroutine started in this loop iteration queued its request
        else:  # every prefix already used the whole budget
            with self._cond:
                self._jobs.pop(request.request_id, None)
            self._complete(job)
        return await job.future

    async def abort(self, request_ids: Any = None) -> None:
        """Aborted requests end at the running batch's next check (queued ones at once). While the engine is paused
        without abort, a batch that still holds requests not aborted ends them at :meth:`resume`."""
        with self._cond:
            for rid, job in self._jobs.items():
                if request_ids is None or rid in request_ids:
                    job.aborted = True
            self._cond.notify_all()
        await self._command(lambda: None)  # the thread has seen it: aborted rows are stopping

    async def pause(self, *, abort: bool = True) -> None:
        with self._cond:
            self._paused = True
            if abort:
                for job in self._jobs.values():
                    job.aborted = True
            self._cond.notify_all()
        await self._command(lambda: None)

    async def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        if not self.threaded:
            self._drain()  # requests queued while paused

    async def receive(self, version: int, source: WeightSource) -> None:
        if isinstance(source, SharedModule):
            if not self.shared:
                raise ValueError("SharedModule: this engine's module is not the trainer's (it was loaded apart)")
            await self._command(lambda: self._set_version(version))
        elif isinstance(source, SnapshotFolder):
            await self._command(lambda: self._load_folder(version, source))
        elif isinstance(source, BucketStream):
            await self._command(lambda: self._load_buckets(version, source))
        else:
            raise TypeError(f"unknown weight source {type(source).__name__}")

    async def run_on_thread(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine's thread, between batches, and return its result (here when not threaded): work
        that shares the engine's module runs on the thread that generates, so that one OS thread runs the heavy
        torch compute (each thread that runs torch ops has an OpenMP pool of its own, and two pools' spinning
        workers take each other's cores)."""
        return await self._command(fn)

    async def health(self) -> EngineHealth:
        alive = not self._closed and (self._thread is None or self._thread.is_alive())
        detail = "" if alive else f"engine thread stopped: {self._error!r}" if self._error else "closed"
        return EngineHealth(ok=alive, version=self.version, detail=detail)

    async def close(self) -> None:
        self.shutdown()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the thread (synchronous; requests still queued fail)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is None:
            self._fail_all(RuntimeError("the hf engine was closed"))
        elif self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)

    def weight_template(self) -> Mapping[str, Any]:
        if self.merger is not None and self.lora is not None:  # the fast path brings adapters
            from relax_hpc.models.lora import adapter_template

            return adapter_template(self.model, self.lora)
        return self.model.state_dict()

    def metrics(self) -> dict[str, float]:
        """Decode-step occupancy since the last call: ``perf/decode_occupancy`` (mean active rows / rows of the
        decode steps), ``perf/decode_low_occupancy_time`` (seconds decoding with < 25 % of the rows active),
        ``perf/decode_time``, ``perf/decode_steps``; and the pool's size."""
        out = self.occupancy.take()
        if out and self.slots:
            out["perf/decode_slots"] = float(self.slots)
        return out

    # ------------------------------------------------------------------------------------------ requests
    def _units(self, job: _Job) -> list[_Unit]:
        r, s = job.request, job.request.sampling
        prompt = [int(t) for t in r.prompt_ids]
        pooled = bool(self.slots) and r.multimodal is None and not s.stop and len(prompt) > 0
        if r.prefixes is None:
            return [_Unit(job, prompt, s.n, list(range(s.n)), s.max_new_tokens, pooled)]
        units = []
        for j, p in enumerate(r.prefixes):
            budget = s.max_new_tokens - len(p.token_ids)
            if budget <= 0:
                job.outputs[j] = _empty("length", self.version)
                continue
            units.append(_Unit(job, prompt + [int(t) for t in p.token_ids], 1, [j], budget, pooled))
        return units

    def _kick(self) -> None:
        with self._cond:
            self._ready.extend(self._incoming)
            self._incoming.clear()
            self._cond.notify_all()
        if not self.threaded:
            self._drain()

    def _drain(self) -> None:
        """Not threaded: run every ready batch now, on this thread."""
        while not self._closed:
            batch = self._take_batch()
            if batch is None:
                return
            self._generate_batch(batch)

    def _check_open(self) -> None:
        if self._closed or (self._thread is not None and not self._thread.is_alive()):
            raise RuntimeError(f"the hf engine is closed{f': {self._error!r}' if self._error else ''}")

    async def _command(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread (between batches, or at the next check of a running batch); not
        threaded: here, now."""
        if not self.threaded:
            self._check_open()
            return fn()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        with self._cond:
            self._check_open()
            self._commands.append((fn, loop, fut))
            self._cond.notify_all()
        return await fut

    # ------------------------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        import torch

        torch.set_num_threads(self._threads)
        try:
            while True:
                batch = self._next_batch()
                if batch is None:
                    break
                self._generate_batch(batch)
        except BaseException as exc:  # the thread must not die silently: fail everything in flight
            log.exception("hf engine thread failed")
            self._error = exc
        finally:
            self._fail_all(self._error or RuntimeError("the hf engine was closed"))

    # ------------------------------------------------------------------------------------------ the slot pool
    def _run_pool(self) -> None:
        """The thread's loop with a slot pool: commands; aborted rows end; queued rows take the free slots (their
        prefill between two runs of decode steps); ``check_every`` decode steps; the rows that ended complete their
        requests. Requests the pool does not take (multimodal prompts, stop strings) run as static batches between
        two runs."""
        import torch

        torch.set_num_threads(self._threads)
        try:
            while self._pool_round():
                pass
        except BaseException as exc:
            log.exception("hf engine thread failed")
            self._error = exc
        finally:
            self._fail_all(self._error or RuntimeError("the hf engine was closed"))

    def _pool_round(self) -> bool:
        """One round of :meth:`_run_pool`; False once closed."""
        self._service(hold=None)
        pool = self._slot_pool()
        with self._cond:
            if self._closed:
                return False
            paused = self._paused
            aborted = [i for i, tag in enumerate(pool.tags) if tag is not None and tag[0].job.aborted]
            ended = self._drop_aborted_rows()
        self._deliver_rows(ended, [])
        if aborted:
            self._deliver_rows([], pool.evict(aborted))
        if paused:  # rows in slots are held; weights may be received meanwhile
            with self._cond:
                if not self._commands and self._paused and not self._closed:
                    self._cond.wait(timeout=1.0)
            return True
        static = self._take_batch()
        if static is not None:
            self._generate_batch(static)
            return True
        pool.set_version(self.version)
        rows = self._admissions(len(pool.free()))
        if rows:
            self._pool_call(rows, lambda: pool.admit(rows))
        if pool.active:
            self._pool_call(None, pool.run)
            return True
        with self._cond:
            if not self._commands and not self._closed and not self._ready:
                self._cond.wait(timeout=1.0)
        return True

    def _slot_pool(self) -> Any:
        if self._pool is None:
            from relax_hpc.rollout.slots import SlotPool

            self._pool = SlotPool(self.model, self.slots, length=max(1, self.slot_length), pad_id=self.pad_id,
                                  compiled=self.compile_decode, occupancy=self.occupancy)
        return self._pool

    def _pool_call(self, rows: list[Any] | None, fn: Callable[[], list[Any]]) -> None:
        """``fn`` (an admission of ``rows``, or a run of the pool) and the rows that ended. If an admission raises,
        its requests fail (their rows leave the pool); if a run raises, every request in the pool fails and the pool
        is rebuilt. The engine goes on either way."""
        try:
            finished = fn()
        except Exception as exc:
            log.exception("hf engine: the slot pool failed")
            pool = self._pool
            if rows is not None:
                jobs = {id(r.tag[0].job): r.tag[0].job for r in rows}
                mine = [i for i, t in enumerate(pool.tags) if t is not None and id(t[0].job) in jobs]
                pool.evict(mine)
            else:
                jobs = {id(t[0].job): t[0].job for t in pool.tags if t is not None}
                self._pool = None
            for job in jobs.values():
                job.loop.call_soon_threadsafe(_set_exception, job.future, exc)
                with self._cond:
                    self._jobs.pop(job.request.request_id, None)
            return
        self._deliver_rows([], finished)

    def _admissions(self, free: int) -> list[Any]:
        """Rows for ``free`` slots: the samples of the queued pooled units, in order (a unit may be placed in part;
        the rest of it goes first next time)."""
        from relax_hpc.rollout.slots import RowSpec, row_key

        rows: list[RowSpec] = []
        with self._cond:
            for u in [u for u in self._ready if u.pooled]:
                if len(rows) >= free:
                    break
                s = u.job.request.sampling
                if u.seed is None:
                    u.seed = s.seed if s.seed is not None else int(self._rng.integers(2**62))
                    u.started = time.perf_counter()
                stops = (self.eos_id, *s.stop_token_ids)
                take = min(u.n - u.admitted, free - len(rows))
                for k in range(u.admitted, u.admitted + take):
                    rows.append(RowSpec(u.context, u.budget, s.temperature, s.top_k, s.top_p, stops,
                                        row_key(u.seed, u.samples[k]), id(u), (u, k)))
                u.admitted += take
                if u.admitted == u.n:
                    self._ready.remove(u)
        return rows

    def _drop_aborted_rows(self) -> list[tuple[Any, SampleOutput]]:
        """Queued pooled samples of aborted requests: they end now, without tokens (under the lock)."""
        out = []
        for u in [u for u in self._ready if u.pooled and u.job.aborted]:
            out += [((u, k), _empty("abort", self.version)) for k in range(u.admitted, u.n)]
            u.admitted = u.n
            self._ready.remove(u)
        return out

    def _deliver_rows(self, ended: list[tuple[Any, SampleOutput]], finished: list[Any]) -> None:
        """Record the samples of pooled rows that ended; complete the requests whose last sample this was."""
        now = time.perf_counter()
        for f in finished:
            u = f.tag[0]
            mask = np.ones(len(f.tokens), dtype=np.uint8)
            ended.append((f.tag, SampleOutput(token_ids=f.tokens, logprobs=f.logprobs, versions=f.versions,
                                              finish_reason=f.reason, loss_mask=mask,
                                              timings={"generate": now - u.started})))
        done: list[_Job] = []
        for (u, k), out in ended:
            u.outs[k] = out
            if len(u.outs) == u.n:
                self._finish_unit(u.job, [(u.samples[j], o) for j, o in sorted(u.outs.items())], done)
        self._complete_all(done)

    def _next_batch(self) -> list[_Unit] | None:
        """Wait for work; run commands meanwhile. None once closed."""
        while True:
            self._service(hold=None)
            with self._cond:
                if self._closed:
                    return None
                take = self._take_batch()
                if take is not None:
                    return take
                if not self._commands:
                    self._cond.wait(timeout=1.0)

    def _take_batch(self) -> list[_Unit] | None:
        """The next batch: the oldest ready unit and up to ``batch_prompts`` - 1 more ready units of the same
        settings, in order (aborted ones end at once); None when nothing is ready or the engine is paused."""
        with self._cond:
            for u in [u for u in self._ready if u.job.aborted and not u.pooled]:
                self._ready.remove(u)
                self._finish_unit(u.job, [(j, _empty("abort", self.version)) for j in u.samples])
            static = [u for u in self._ready if not u.pooled]
            if not static or self._paused:
                return None
            key = static[0].key()
            take = [u for u in static if u.key() == key][:self.batch_prompts]
            for u in take:
                self._ready.remove(u)
            return take

    def _service(self, *, hold: _Batch | None) -> None:
        """Run pending commands; inside a batch (``hold``) also wait here while paused without abort."""
        while True:
            with self._cond:
                cmds, self._commands = self._commands, []
                if not cmds:
                    if hold is None or not self._paused or self._closed or not hold.held():
                        return
                    self._cond.wait(timeout=1.0)
                    continue
            for fn, loop, fut in cmds:
                try:
                    res = fn()
                except BaseException as exc:
                    loop.call_soon_threadsafe(_set_exception, fut, exc)
                else:
                    loop.call_soon_threadsafe(_set_result, fut, res)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._closed = True
            jobs, self._jobs = list(self._jobs.values()), {}
            cmds, self._commands = self._commands, []
            self._ready.clear()
            self._incoming.clear()
        for job in jobs:
            job.loop.call_soon_threadsafe(_set_exception, job.future, RuntimeError(f"hf engine stopped: {exc!r}"))
        for _, loop, fut in cmds:
            loop.call_soon_threadsafe(_set_exception, fut, RuntimeError(f"hf engine stopped: {exc!r}"))

    def _finish_unit(self, job: _Job, outputs: list[tuple[int, SampleOutput]],
                     done: list[_Job] | None = None) -> None:
        """Record a unit's samples; a job whose last unit this was completes now, or is appended to ``done`` (the
        caller completes those together: :meth:`_complete_all`)."""
        for j, out in outputs:
            job.outputs[j] = out
        with self._cond:
            job.open_units -= 1
            if job.open_units > 0:
                return
            self._jobs.pop(job.request.request_id, None)
        if done is not None:
            done.append(job)
        else:
            self._complete_all([job])

    def _result(self, job: _Job) -> GenerateResult:
        return GenerateResult(job.request.request_id, [o if o is not None else _empty("abort", self.version)
                                                       for o in job.outputs])

    def _complete(self, job: _Job) -> None:
        self._complete_all([job])

    def _complete_all(self, jobs: list[_Job]) -> None:
        """Set the jobs' futures with one wake-up per event loop: a wake-up per job would hand the GIL back and forth
        between this thread and the loop's once per request (16 hand-overs per demo batch)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
        for job in jobs:
            by_loop.setdefault(job.loop, []).append((job.future, self._result(job)))
        for loop, pairs in by_loop.items():
            if self.threaded:
                loop.call_soon_threadsafe(_set_results, pairs)
            else:  # batches run inside the loop's own callbacks
                loop.call_soon(_set_results, pairs)

    # ------------------------------------------------------------------------------------------ weights
    def _set_version(self, version: int) -> None:
        self.version = int(version)

    def _load_folder(self, version: int, source: SnapshotFolder) -> None:
        from relax_hpc.weights import copy_state_into, load_snapshot

        verify = "size" if source.verify == "none" else source.verify
        state, _ = load_snapshot(source.path, device="cpu", verify=verify)
        if self._adapter(state):
            self.merger.apply(state)
        else:
            copy_state_into(self.model, state, source=str(source.path))
        self.version = int(version)

    def _adapter(self, state: Mapping[str, Any]) -> bool:
        """Whether ``state`` is an adapter's (merged, not copied); an adapter on an engine without ``model.lora``
        or a full state on one with it is an error."""
        from relax_hpc.errors import SnapshotError
        from relax_hpc.models.lora import is_adapter_state

        adapter = is_adapter_state(state)
        if adapter != (self.merger is not None):
            raise SnapshotError("an adapter's weights for an engine without model.lora" if adapter else
                                "full weights for an engine of an adapter (model.lora)")
        return adapter

    def _load_buckets(self, version: int, source: BucketStream) -> None:
        import torch

        from relax_hpc.errors import SnapshotError
        from relax_hpc.weights import copy_state_into

        if self.merger is not None:  # an adapter: small, merged as a whole
            state: dict[str, Any] = {}
            for bucket in source.buckets():
                state.update(bucket)
            self._adapter(state)
            self.merger.apply(state)
            self.version = int(version)
            return
        dest = self.model.state_dict()
        seen: set[int] = set()
        names: set[str] = set()
        for bucket in source.buckets():
            unknown = sorted(set(bucket) - set(dest))
            if unknown:
                raise SnapshotError(f"bucket stream: tensors the model does not have: {unknown[:5]}")
            copy_state_into({k: dest[k] for k in bucket}, bucket, source="bucket stream")
            names.update(bucket)
            seen.update(dest[k].data_ptr() for k in bucket)
        missing = [k for k, t in dest.items() if k not in names and isinstance(t, torch.Tensor)
                   and t.data_ptr() not in seen]  # tied weights share storage with a received tensor
        if missing:
            raise SnapshotError(f"bucket stream of version {version} lacks {missing[:5]}: the model was only "
                                "partly updated")
        self.version = int(version)

    # ------------------------------------------------------------------------------------------ generation
    def _generate_batch(self, units: list[_Unit]) -> None:
        import torch

        batch = _Batch(self, units, self.check_every)
        s = units[0].job.request.sampling
        mm = units[0].job.request.multimodal
        if mm:  # omni-modal: the names this model's generate takes (Omni thinkers: video_second_per_grid)
            from relax_hpc.models.mrope import generate_kwargs

            mm = generate_kwargs(self.model, mm)
        if self._loop is None:
            from relax_hpc.rollout.decode import loop_supported

            self._loop = loop_supported(self.model)
        seed = s.seed if s.seed is not None else int(self._rng.integers(2**62))
        was_training = self.model.training
        self.model.eval()
        t0 = time.perf_counter()
        try:
            ids, attn = self._left_pad([u.context for u in units])
            extra: dict[str, Any] = {k: torch.as_tensor(v).to(self.device) for k, v in (mm or {}).items()}
            if self._synced():
                extra["synced_gpus"] = True
            if self._loop and not extra and not s.stop:
                seqs, logp = self._sample(ids, attn, units[0], seed, batch)
            else:
                seqs, logp = self._hf_generate(ids, attn, units[0], seed, batch, extra)
        except Exception as exc:
            for u in units:
                u.job.loop.call_soon_threadsafe(_set_exception, u.job.future, exc)
                with self._cond:
                    self._jobs.pop(u.job.request.request_id, None)
            return
        finally:
            if was_training:
                self.model.train()
        self._deliver(batch, seqs.numpy(), logp.numpy(), (time.perf_counter() - t0) / max(1, len(batch.rows)))

    def _synced(self) -> bool:
        """Sharded (FSDP) weights: every rank must run the same number of forward passes, whatever its prompts."""
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _left_pad(self, contexts: list[list[int]]) -> tuple[Any, Any]:
        """Left-padded ids and attention mask of ``contexts`` (built in numpy: one tensor per batch, not per row)."""
        import torch

        lengths = np.fromiter((len(c) for c in contexts), dtype=np.int64, count=len(contexts))
        width = int(lengths.max())
        attn = np.arange(width)[None, :] >= (width - lengths)[:, None]
        ids = np.full((len(contexts), width), self.pad_id, dtype=np.int64)
        ids[attn] = np.fromiter(itertools.chain.from_iterable(contexts), dtype=np.int64, count=int(lengths.sum()))
        return torch.from_numpy(ids).to(self.device), torch.from_numpy(attn.astype(np.int64)).to(self.device)

    def _sample(self, ids: Any, attn: Any, unit: _Unit, seed: int, batch: _Batch) -> tuple[Any, Any]:
        import torch

        from relax_hpc.rollout.decode import sample
        from relax_hpc.rollout.graph_decode import graph_decoder

        s = unit.job.request.sampling
        graphs = graph_decoder(self) if not s.stop_token_ids else None
        if graphs is not None:  # CUDA: the CUDA-graph loop; aborts and shorter budgets take effect as the batch ends
            torch.cuda.manual_seed(seed)
            seqs, logp = graphs.sample(ids, attn, n=unit.n, max_new_tokens=batch.budget, temperature=s.temperature,
                                       top_k=s.top_k, top_p=s.top_p, eos_id=self.eos_id, pad_id=self.pad_id)
            return seqs.cpu(), logp.cpu()
        gen = torch.Generator(device=ids.device).manual_seed(seed)
        seqs, logp = sample(self.model, ids, attn, n=unit.n, max_new_tokens=batch.budget,
                            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, eos_id=self.eos_id,
                            pad_id=self.pad_id, stop_ids=s.stop_token_ids, generator=gen, control=batch)
        return seqs.cpu(), logp.cpu()

    def _hf_generate(self, ids: Any, attn: Any, unit: _Unit, seed: int, batch: _Batch,
                     extra: dict[str, Any]) -> tuple[Any, Any]:
        """transformers ``generate``: (response tokens ``[B*n, R]``, their log-probs) on the CPU."""
        import torch

        s = unit.job.request.sampling
        greedy = s.temperature == 0
        temperature = 1.0 if greedy else s.temperature
        width = ids.shape[1]
        repeat = unit.n if greedy else 1  # generate refuses n greedy sequences: they are one sequence n times
        n = 1 if greedy else unit.n
        eos = [self.eos_id, *s.stop_token_ids] if s.stop_token_ids else self.eos_id
        devices = [ids.device] if ids.device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            gen = self.model.generate(
                input_ids=ids, attention_mask=attn, do_sample=not greedy,
                temperature=temperature if not greedy else None, top_p=s.top_p if not greedy else None,
                top_k=s.top_k if not greedy else None, max_new_tokens=batch.budget,
                num_return_sequences=n, return_dict_in_generate=True, output_logits=True,
                pad_token_id=self.pad_id, eos_token_id=eos, stopping_criteria=[_Criterion(batch, width, repeat)],
                stop_strings=list(s.stop) or None, tokenizer=self.tokenizer if s.stop else None, **extra,
            )
        seqs = gen.sequences[:, width:].cpu()
        logits = torch.stack(gen.logits, dim=1).float().cpu()  # [B*n, R, V]
        logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, seqs[..., None])[..., 0]
        return seqs.repeat_interleave(repeat, dim=0), logp.repeat_interleave(repeat, dim=0)

    def _deliver(self, batch: _Batch, seqs: np.ndarray, logp: np.ndarray, per_row: float) -> None:
        """Each row's sample: views into batch-level arrays (tokens, log-probs, per-token versions, loss masks; one
        array each per batch, so no two samples share memory), no per-row copies."""
        s = batch.units[0].job.request.sampling
        lengths, reasons = _response_lengths(seqs, {self.eos_id, *s.stop_token_ids}, self.pad_id, batch, bool(s.stop))
        rows, width = seqs.shape
        versions = np.repeat(batch.token_versions(width)[None, :], rows, axis=0)
        seqs = np.array(seqs, dtype=np.int32)  # one copy per batch: the samples own no torch memory
        logp = np.array(logp, dtype=np.float32)
        masks = np.ones((rows, width), dtype=np.uint8)
        ends = lengths.tolist()
        self.occupancy.add_batch(lengths, width, per_row * rows)
        done: list[_Job] = []
        row = 0
        for u in batch.units:
            outs = []
            for j in u.samples:
                n = ends[row]
                outs.append((j, SampleOutput(
                    token_ids=seqs[row, :n], logprobs=logp[row, :n], versions=versions[row, :n],
                    finish_reason=reasons[row], loss_mask=masks[row, :n],  # type: ignore[arg-type]
                    timings={"generate": per_row})))
                row += 1
            self._finish_unit(u.job, outs, done)
        self._complete_all(done)


class _Criterion:
    """transformers stopping criterion that lets the engine stop (abort) or hold rows of a ``generate`` batch."""

    def __init__(self, batch: _Batch, width: int, repeat: int):
        self.batch, self.width, self.repeat = batch, width, repeat
        self.stopped: set[int] = set()

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        generated = input_ids.shape[1] - self.width
        if generated % self.batch.every == 0:
            for r in self.batch.check(generated):
                self.stopped.add(r // self.repeat)  # greedy rows are generated once, repeated after
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if self.stopped:
            done[torch.tensor(sorted(self.stopped), dtype=torch.long, device=input_ids.device)] = True
        return done


def _response_length(toks: np.ndarray, stops: set[int], pad: int, budget: int, stopped_at: int | None,
                     stop_strings: bool) -> tuple[int, str]:
    """Tokens up to and including the first stop token; an aborted row ends where it was stopped; ``generate`` pads
    rows that ended on a stop string with ``pad``."""
    limit = min(len(toks), budget) if stopped_at is None else min(stopped_at, len(toks), budget)
    hits = np.nonzero(np.isin(toks[:limit], list(stops)))[0]
    if len(hits):
        return int(hits[0]) + 1, "stop"
    if stopped_at is not None and stopped_at < budget:
        return limit, "abort"
    if stop_strings and pad not in stops:
        pads = np.nonzero(toks[:limit] == pad)[0]
        if len(pads):
            return int(pads[0]), "stop"
    if stop_strings and limit < budget:
        return limit, "stop"
    return limit, "length"


def _response_lengths(seqs: np.ndarray, stops: set[int], pad: int, batch: _Batch,
                      stop_strings: bool) -> tuple[np.ndarray, list[str]]:
    """:func:`_response_length` of every row of a batch: vectorised for the rows that ran to a stop token or their
    budget (the common case), row by row for aborted rows and stop strings."""
    rows, width = seqs.shape
    budgets = np.array([u.budget for u in batch.rows], dtype=np.int64)
    limits = np.minimum(budgets, width)
    hit = np.isin(seqs, list(stops)) & (np.arange(width)[None, :] < limits[:, None])
    has = hit.any(axis=1)
    lengths = np.where(has, hit.argmax(axis=1) + 1, limits)
    reasons = ["stop" if h else "length" for h in np.asarray(has).tolist()]
    special: Iterable[int] = set(batch.stopped_at) if not stop_strings else range(rows)
    for r in special:
        n, why = _response_length(seqs[r], stops, pad, int(budgets[r]), batch.stopped_at.get(r), stop_strings)
        lengths[r], reasons[r] = n, why
    return lengths, reasons


def _empty(reason: str, version: int) -> SampleOutput:
    return SampleOutput(token_ids=np.zeros(0, np.int32), logprobs=np.zeros(0, np.float32),
                        versions=np.zeros(0, np.int32), finish_reason=reason,  # type: ignore[arg-type]
                        loss_mask=np.zeros(0, np.uint8))


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_results(pairs: list[tuple[asyncio.Future[Any], Any]]) -> None:
    for fut, value in pairs:
        _set_result(fut, value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _poolable(model: Any) -> bool:
    from relax_hpc.rollout.graph_decode import supported

    return supported(model)


def from_config(cfg: Any, *, device: str | None, seed: int, tokenizer: Any, model: Any = None,
                colocated: bool = False) -> HFEngine:
    """The ``hf`` engine of a recipe: on ``model`` (shared, colocate) or on its own copy loaded from ``cfg.model``.
    ``colocated``: it runs beside the trainer (colocate), on the trainer's module or, where the trainer's module is
    no HF model (megatron), on a copy of its own."""
    from relax_hpc.models.load import load_model, resolve_device, resolve_dtype

    shared = model is not None
    if model is None:
        device = device or resolve_device(cfg.rollout.device)
        model = load_model(cfg.model, tokenizer, device=device, dtype=resolve_dtype(cfg.model.dtype, device))
    dev = device or str(next(model.parameters()).device)
    r = cfg.rollout
    # an engine of its own (fully_async workers, eval, GenRM) keeps a pool of batch_prompts x n_samples decode
    # slots full as requests arrive; the trainer's engine (colocate, shared or a copy of its own) decodes each step's
    # batch at once (the same samples whichever backend trains: the pool draws its samples in another order), or,
    # with partial rollouts, in a pool of a step's rows on a thread of its own (a group's requests return as they
    # end, so the step can stop once enough groups are whole)
    step_engine = shared or colocated
    partial = step_engine and r.partial is not None
    slots = 0 if step_engine and not partial else r.batch_prompts * r.n_samples
    if partial:
        slots = math.ceil(r.prompts_per_step * r.partial.overprovision) * r.n_samples
    return HFEngine(model, tokenizer, r.sampling, device=dev, batch_prompts=r.batch_prompts, seed=seed,
                    decoder=r.hf_decoder if r.engine == "hf" else "auto", shared=shared,
                    threaded=not shared or partial,
                    slots=slots, slot_length=cfg.data.max_prompt_tokens + r.sampling.max_new_tokens,
                    lora=cfg.model.lora)

