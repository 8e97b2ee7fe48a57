"""Media preprocessing in worker processes: decode, resize, sample frames and extract features away from the rollout.

:class:`ProcessorPool` starts ``size`` worker processes once (``spawn``); each holds a copy of the
:class:`~relax_hpc.models.multimodal.MultimodalPreprocessor` (processor configs only, no model, no tokenizer) and takes
one job at a time, through its own pair of pipes (a worker killed mid-write cannot block the others, as a shared
queue's lock would): a prompt's media references and options. A worker writes all tensors of a job into one
``multiprocessing.shared_memory`` block and sends back only its name and layout (name, dtype, shape, offset per
tensor); the parent copies the arrays out once and unlinks the block, so no large array is ever pickled. A worker that
dies (or exceeds ``item_timeout_s`` on one item, then it is killed) is restarted and its item retried once; a second
failure skips the item, like a media error.

:class:`PrefetchingStream` wraps a :class:`~relax_hpc.data.stream.PromptStream` with the ``next_batch(n)`` interface:
a pump thread keeps ``prefetch_batches * n`` prompts submitted ahead, so preprocessing overlaps generation; the time
``next_batch`` spends waiting for tensors is accumulated (``data/preprocess_wait_s``). Its ``state()`` is the stream
position after the last prompt handed out, so a resumed run takes exactly the prompts an uninterrupted run would.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import connection, shared_memory
from typing import Any

import numpy as np

from relax_hpc.errors import WaitTimeout

log = logging.getLogger(__name__)
_ALIGN = 64
_KEYS = itertools.count(1)
"""Job keys of all prefetching streams of this process (a pool may serve one stream after another)."""


@dataclass
class Job:
    """One prompt's media to preprocess."""

    key: int
    images: list[Any]
    audios: list[Any]
    videos: list[Any]
    options: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0
    started: float = 0.0
    label: str = ""
    """What the item is, for log lines (the prompt's source)."""


@dataclass
class Result:
    """Tensors of a job, or why there are none (``error``: one line)."""

    key: int
    tensors: dict[str, np.ndarray] | None
    counts: Any = None
    error: str | None = None


# ------------------------------------------------------------------------------------------------ shared memory
def pack_shared(arrays: dict[str, np.ndarray]) -> tuple[str, list[tuple[str, str, tuple[int, ...], int]]]:
    """Copy ``arrays`` into one new shared-memory block; (block name, [(key, dtype, shape, offset)]). The block is
    closed here, not unlinked: :func:`unpack_shared` unlinks it."""
    layout = []
    offset = 0
    for k, a in arrays.items():
        layout.append((k, a.dtype.str, tuple(a.shape), offset))
        offset += -(-a.nbytes // _ALIGN) * _ALIGN
    shm = shared_memory.SharedMemory(create=True, size=max(offset, 1))
    try:
        for (_k, dt, shape, off), a in zip(layout, arrays.values(), strict=True):
            np.ndarray(shape, dtype=dt, buffer=shm.buf, offset=off)[...] = a
    finally:
        shm.close()
    return shm.name, layout


def unpack_shared(name: str, layout: list[tuple[str, str, tuple[int, ...], int]]) -> dict[str, np.ndarray]:
    """The arrays of a block made by :func:`pack_shared` (copied out); the block is unlinked."""
    shm = shared_memory.SharedMemory(name=name)
    try:
        return {k: np.ndarray(shape, dtype=dt, buffer=shm.buf, offset=off).copy() for k, dt, shape, off in layout}
    finally:
        shm.close()
        shm.unlink()


# ------------------------------------------------------------------------------------------------ worker
def _worker_main(preprocessor: Any, jobs: Any, results: Any, wid: int) -> None:
    from relax_hpc.data.media import MediaError

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops workers; Ctrl-C goes to the parent only
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    variants: dict[tuple[Any, ...], Any] = {}
    results.send(("ready", wid, os.getpid(), None))
    while True:
        try:
            job = jobs.recv()
        except EOFError:  # the parent is gone
            return
        if job is None:
            return
        try:
            key = tuple(sorted(job.options.items()))
            if key not in variants:
                variants[key] = preprocessor.with_options(job.options)
            pre = variants[key]
            arrays = pre.tensors(job.images, job.audios, job.videos)
            counts = pre.token_counts(arrays)
            msg: tuple[Any, ...] = ("ok", wid, job.key, (*pack_shared(arrays), counts))
        except MediaError as exc:
            msg = ("error", wid, job.key, str(exc))
        except Exception as exc:  # one item's failure must not take the worker down; the item is skipped
            msg = ("error", wid, job.key, f"{type(exc).__name__}: {exc}".splitlines()[0])
        results.send(msg)


@dataclass
class _Worker:
    proc: Any
    jobs: Any
    """Send end of the job pipe."""
    results: Any
    """Receive end of the result pipe."""
    job: Job | None = None
    dead: bool = False


class ProcessorPool:
    """``size`` preprocessing worker processes (see the module docstring). Not thread-safe: one thread drives it."""

    def __init__(self, preprocessor: Any, size: int, *, item_timeout_s: float = 300.0,
                 start_timeout_s: float = 120.0):
        assert size >= 1
        self._pre = preprocessor
        self._ctx = mp.get_context("spawn")
        self.item_timeout_s = item_timeout_s
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self._backlog: deque[Job] = deque()
        self._done: deque[Result] = deque()
        self._workers: list[_Worker] = [self._spawn(i) for i in range(size)]
        self._wait_ready(set(range(size)))

    def _spawn(self, wid: int) -> _Worker:
        job_r, job_w = self._ctx.Pipe(duplex=False)
        res_r, res_w = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=_worker_main, args=(self._pre, job_r, res_w, wid), daemon=True,
                                 name=f"relax-media-{wid}")
        proc.start()
        job_r.close()
        res_w.close()
        return _Worker(proc, job_w, res_r)

    def _wait_ready(self, wids: set[int]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while wids:
            left = deadline - time.monotonic()
            if left <= 0 or any(not self._workers[w].proc.is_alive() for w in wids):
                self.close()
                raise WaitTimeout(f"media pool: workers {sorted(wids)} not ready after {self.start_timeout_s:.0f} s "
                                  "(or died while starting)")
            for msg in self._receive(min(left, 0.5)):
                if msg[0] == "ready":
                    wids.discard(msg[1])
                else:
                    self._handle(msg)

    def _receive(self, timeout: float) -> list[tuple[Any, ...]]:
        """Messages from the live workers' result pipes within ``timeout``; a closed pipe marks its worker dead."""
        conns = {w.results: w for w in self._workers if not w.dead}
        out = []
        for conn in connection.wait(list(conns), timeout=timeout):
            try:
                out.append(conn.recv())  # type: ignore[union-attr]
            except (EOFError, OSError):
                conns[conn].dead = True
        return out

    # ------------------------------------------------------------------------------------------ driving
    def submit(self, job: Job) -> None:
        """Queue ``job``; it goes to the next idle worker."""
        self._backlog.append(job)
        self._dispatch()

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet returned by :meth:`get`."""
        return len(self._backlog) + sum(w.job is not None for w in self._workers) + len(self._done)

    def _dispatch(self) -> None:
        for w in self._workers:
            if w.job is None and self._backlog:
                job = self._backlog.popleft()
                job.started = time.monotonic()
                w.job = job
                try:
                    w.jobs.send(job)
                except OSError:  # died meanwhile: _check_workers restarts it and retries the job
                    w.dead = True

    def get(self, timeout: float) -> Result | None:
        """The next finished job (in completion order), or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self._done:
            self._check_workers()
            self._dispatch()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            for msg in self._receive(min(left, 0.2)):
                self._handle(msg)
        return self._done.popleft()

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind, wid, key, payload = msg
        if kind == "ready":
            return
        w = self._workers[wid]
        if w.job is None or w.job.key != key:  # a result of a worker already given up on (hung, then killed)
            if kind == "ok":
                unpack_shared(payload[0], payload[1])
            return
        w.job = None
        if kind == "ok":
            name, layout, counts = payload
            self._done.append(Result(key, unpack_shared(name, layout), counts))
        else:
            self._done.append(Result(key, None, error=payload))
        self._dispatch()

    def _check_workers(self) -> None:
        now = time.monotonic()
        for wid, w in enumerate(self._workers):
            hung = w.job is not None and now - w.job.started > self.item_timeout_s
            if w.proc.is_alive() and not hung and not w.dead:
                continue
            if w.proc.is_alive():  # hung, or its pipe broke
                w.proc.kill()
            w.proc.join(timeout=10)
            w.jobs.close()
            w.results.close()
            why = f"timed out after {self.item_timeout_s:.0f} s" if hung else f"exit code {w.proc.exitcode}"
            job = w.job
            self._workers[wid] = self._spawn(wid)
            self.restarts += 1
            log.warning("media pool: worker %d died (%s)%s; restarted", wid, why,
                        f" on item {job.label or job.key}" if job else "")
            self._wait_ready({wid})
            if job is not None:
                job.attempts += 1
                if job.attempts <= 1:
                    self._backlog.appendleft(job)
                else:
                    self._done.append(Result(job.key, None, error=f"its media preprocessing worker died twice ({why})"))

    def close(self) -> None:
        """Stop the workers (each given 10 s, then killed) and free the blocks of results nobody took."""
        for w in self._workers:
            if w.proc.is_alive():
                with contextlib.suppress(OSError):
                    w.jobs.send(None)
        for w in self._workers:
            w.proc.join(timeout=10)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=10)
        for w in self._workers:  # results nobody took: free their blocks
            while not w.results.closed and w.results.poll(0):
                try:
                    msg = w.results.recv()
                except (EOFError, OSError):
                    break
                if msg[0] == "ok":
                    unpack_shared(msg[3][0], msg[3][1])
            w.jobs.close()
            w.results.close()
        self._done.clear()

    def __enter__(self) -> ProcessorPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------ prefetching stream
@dataclass
class _Slot:
    prompt: Any
    state: dict[str, int]
    ready: bool = False
    failed: str | None = None


class PrefetchingStream:
    """``next_batch(n)`` over a :class:`~relax_hpc.data.stream.PromptStream` whose media tensors are made by a
    :class:`ProcessorPool` ahead of time (see the module docstring)."""

    def __init__(self, stream: Any, pool: ProcessorPool, *, prefetch_batches: int = 2, wait_timeout_s: float = 600.0,
                 owns_pool: bool = False):
        self.stream = stream
        self.pool = pool
        self.owns_pool = owns_pool
        """:meth:`close` closes the pool too."""
        self.prefetch_batches = prefetch_batches
        self.wait_timeout_s = wait_timeout_s
        self.wait_s = 0.0
        """Seconds ``next_batch`` waited for tensors, in all."""
        self.num_media_skipped = 0
        self._queue: deque[_Slot] = deque()
        self._by_key: dict[int, _Slot] = {}
        self._want = 0
        self._exhausted = False
        self._state = stream.state()
        self._cond = threading.Condition()
        self._pump_lock = threading.Lock()  # held by the pump thread while it takes prompts or handles a result
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._pump, name="relax-media-prefetch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ consumer side
    def next_batch(self, n: int) -> list[Any]:
        """The next ``n`` prompts with their tensors (fewer once the stream runs out); waits for the pool."""
        out: list[Any] = []
        t0 = time.monotonic()
        with self._cond:
            self._want = max(self._want, n)
            self._cond.notify_all()
            while len(out) < n:
                if self._error is not None:
                    raise self._error
                if self._queue and (self._queue[0].ready or self._queue[0].failed):
                    slot = self._queue.popleft()
                    self._state = slot.state
                    if slot.failed:
                        self.num_media_skipped += 1
                        log.warning("data: skipped prompt %s (%d skipped so far): %s",
                                    slot.prompt.meta.get("index"), self.num_media_skipped, slot.failed)
                    else:
                        out.append(slot.prompt)
                    self._cond.notify_all()
                    continue
                if not self._queue and self._exhausted:
                    break
                if time.monotonic() - t0 > self.wait_timeout_s:
                    raise WaitTimeout(f"media pool: no tensors for the next prompt after {self.wait_timeout_s:.0f} s")
                self._cond.wait(timeout=0.5)
        self.wait_s += time.monotonic() - t0
        return out

    @property
    def exhausted(self) -> bool:
        with self._cond:
            return self._exhausted and not self._queue

    def state(self) -> dict[str, int]:
        """The stream position after the last prompt handed out (not after the prefetched ones)."""
        with self._cond:
            return dict(self._state)

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by :meth:`state`: the prompts prefetched so far are dropped (their results,
        when the pool returns them, are discarded) and prefetching restarts at ``state``, so a resumed run takes
        exactly the prompts an uninterrupted one would, each once."""
        with self._pump_lock, self._cond:
            self._queue.clear()
            self._by_key.clear()
            self.stream.load_state(state)
            self._state = self.stream.state()
            self._exhausted = self.stream.exhausted
            self._cond.notify_all()

    def stats(self) -> dict[str, float]:
        """``data/preprocess_wait_s``, ``data/media_skipped`` and ``data/pool_restarts``."""
        return {"data/preprocess_wait_s": self.wait_s, "data/media_skipped": float(self.num_media_skipped),
                "data/pool_restarts": float(self.pool.restarts)}

    def close(self) -> None:
        """Stop the pump thread; the pool too if this stream owns it (else it is the caller's to close)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        if self.owns_pool:
            self.pool.close()

    # ------------------------------------------------------------------------------------------ pump thread
    def _pump(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stop:
                        return
                    room = self._want * (1 + self.prefetch_batches) - len(self._queue)
                    take = 0 if self._exhausted else room
                with self._pump_lock:
                    if take > 0:
                        self._take(take)
                    res = self.pool.get(timeout=0.1) if self.pool.pending else None
                    if res is not None:
                        self._finish(res)
                if not self.pool.pending:
                    with self._cond:
                        if not self._stop:
                            self._cond.wait(timeout=0.1)
        except BaseException as exc:  # surfaced by next_batch in the consumer thread
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _take(self, n: int) -> None:
        for _ in range(n):
            batch = self.stream.next_batch(1, tensors=False)
            state = self.stream.state()
            with self._cond:
                if not batch:
                    self._exhausted = True
                    self._cond.notify_all()
                    return
                p = batch[0]
                slot = _Slot(p, state, ready=not p.media)
                self._queue.append(slot)
                self._cond.notify_all()
            if p.media:
                key = next(_KEYS)  # never reused: a result of a job dropped by load_state cannot land on a new slot
                self._by_key[key] = slot
                self.pool.submit(Job(key, p.media.get("image", []), p.media.get("audio", []),
                                     p.media.get("video", []), dict(p.meta.get("media_options") or {}),
                                     label=str(p.meta.get("source", ""))))

    def _finish(self, res: Result) -> None:
        slot = self._by_key.pop(res.key, None)
        if slot is None:  # prefetched before load_state moved the position: dropped
            return
        expected = self.stream.dataset.expected_counts(slot.prompt.meta["index"])
        with self._cond:
            if res.tensors is None:
                slot.failed = res.error or "preprocessing failed"
            elif tuple(res.counts) != tuple(expected):
                slot.failed = (f"{slot.prompt.meta.get('source')}: its media changed since the data was loaded "
                               f"(placeholder tokens {res.counts} != {expected})")
            else:
                slot.prompt.multimodal = res.tensors
                slot.ready = True
            self._cond.notify_all()
