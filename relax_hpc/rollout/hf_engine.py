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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_hpc.config.schema import SamplingConfig
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
                 threads: int | None = None, threaded: bool = True):
        import torch

        self.model = model
        self.tokenizer = tokenizer
        self.sampling = sampling_params(sampling or SamplingConfig())
        self.device = device
        self.batch_prompts = batch_prompts
        self.version = 0
        self.shared = shared
        """The module is the trainer's (colocate): :class:`SharedModule` is a valid weight source."""
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
        """False: no thread of its own; queued batches run on the event loop's thread, right after the coroutines
        that queued them (colocate: generation and training strictly alternate, so a thread only adds hand-overs).
        Nothing can reach the engine while such a batch runs, so aborts and pauses act between batches."""
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
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
        return self.model.state_dict()

    # ------------------------------------------------------------------------------------------ requests
    def _units(self, job: _Job) -> list[_Unit]:
        r, s = job.request, job.request.sampling
        prompt = [int(t) for t in r.prompt_ids]
        if r.prefixes is None:
            return [_Unit(job, prompt, s.n, list(range(s.n)), s.max_new_tokens)]
        units = []
        for j, p in enumerate(r.prefixes):
            budget = s.max_new_tokens - len(p.token_ids)
            if budget <= 0:
                job.outputs[j] = _empty("length", self.version)
                continue
            units.append(_Unit(job, prompt + [int(t) for t in p.token_ids], 1, [j], budget))
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
            for u in [u for u in self._ready if u.job.aborted]:
                self._ready.remove(u)
                self._finish_unit(u.job, [(j, _empty("abort", self.version)) for j in u.samples])
            if not self._ready or self._paused:
                return None
            key = self._ready[0].key()
            take = [u for u in self._ready if u.key() == key][:self.batch_prompts]
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
        copy_state_into(self.model, state, source=str(source.path))
        self.version = int(version)

    def _load_buckets(self, version: int, source: BucketStream) -> None:
        import torch

        from relax_hpc.errors import SnapshotError
        from relax_hpc.weights import copy_state_into

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


def from_config(cfg: Any, *, device: str | None, seed: int, tokenizer: Any, model: Any = None) -> HFEngine:
    """The ``hf`` engine of a recipe: on ``model`` (shared, colocate) or on its own copy loaded from ``cfg.model``."""
    from relax_hpc.models.load import load_model, resolve_device, resolve_dtype

    shared = model is not None
    if model is None:
        device = device or resolve_device(cfg.rollout.device)
        model = load_model(cfg.model, tokenizer, device=device, dtype=resolve_dtype(cfg.model.dtype, device))
    dev = device or str(next(model.parameters()).device)
    return HFEngine(model, tokenizer, cfg.rollout.sampling, device=dev, batch_prompts=cfg.rollout.batch_prompts,
                    seed=seed, decoder=cfg.rollout.hf_decoder, shared=shared, threaded=not shared)

