"""Model-based rewards (GenRM): a judge model reads each (question, response, reference) through a prompt template
and writes a verdict; a parser turns the verdict into a score.

:class:`GenRM` is a batched async reward: responses are cut into batches of ``batch_size`` prompts, each batch is one
call of the judge's ``generate`` (run in a worker thread so the event loop keeps going; a coroutine function, such
as :class:`EngineJudge`, is awaited on the loop), batches run concurrently up to ``max_concurrency``, and each call
is bounded by ``timeout_s``. A verdict the parser cannot read scores
``on_unparsed`` and counts as a failure; a call that raises or times out scores ``on_unparsed`` for its whole batch
and counts as an error. :attr:`GenRM.stats` keeps calls, samples, failures, errors and latencies; :func:`judge`
reports them (``genrm/*``) through its context's ``metrics``, which the rollout logs with each batch.

The judge is any ``generate(prompt_token_ids: list[list[int]]) -> list[str]``; :func:`hf_judge` makes one from the
``hf`` engine in-process (a local HF folder, or ``tiny`` for tests), :class:`ServerJudge` one on a server engine
(``sglang`` / ``vllm``) process of its own, separate from the rollout's. From a recipe::

    reward:
      name: relax_hpc.rewards.genrm:judge
      kwargs: {model: /models/judge, template: "...{question}...{response}...{answer}...", pattern: "SCORE: ([0-9.]+)",
               batch_size: 16, max_new_tokens: 64}

``model: rollout`` judges on the rollout's own engine (:class:`EngineJudge`): the policy model itself (self-judging)
at the weights version the rollout holds, on its ``hf`` engine in-process or its ``sglang`` / ``vllm`` server (no
second server). The engine comes through the reward's ``context`` (:class:`~relax_hpc.rewards.api.RewardContext`,
given by the rollout driver's owner: colocate ranks and fully_async workers), never a global. The judge's requests
(ids ``<writer>/genrm-...``, greedy unless ``temperature`` is set, ``max_new_tokens`` of the judge's) go through
the engine's ``generate`` on the driver's event loop, concurrently (the engine batches them); a verdict cut by a
pause for new weights (``abort``) is asked again, whole, so that it comes from one weights version; a call still
waiting after ``timeout_s`` (an engine paused that long) is aborted on the engine and counted as an error. The
values carry ``genrm_version``: the weights version of the engine the last verdicts came from::

    reward:
      name: relax_hpc.rewards.genrm:judge
      kwargs: {model: rollout, template: "...{response}...{answer}...", pattern: "SCORE: ([0-9.]+)", timeout_s: 120}
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relax_hpc.rewards.api import RewardContext, batched, is_async

DEFAULT_TEMPLATE = ("You are grading an answer.\nQuestion: {question}\nReference answer: {answer}\n"
                    "Response: {response}\nReply with 'SCORE: x' where x is 1 if the response is correct, else 0.")
DEFAULT_PATTERN = r"SCORE:\s*([01](?:\.\d+)?)"
SHARED_ENGINE = "rollout"
"""``model`` naming the rollout's own engine as the judge (:class:`EngineJudge`)."""


@dataclass
class JudgeStats:
    """What the judge did (cumulative)."""

    calls: int = 0
    samples: int = 0
    failures: int = 0
    """Verdicts the parser could not read."""
    errors: int = 0
    """Samples whose judge call raised or timed out."""
    latency_s: list[float] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        lat = sorted(self.latency_s)
        return {"genrm/calls": float(self.calls), "genrm/samples": float(self.samples),
                "genrm/failures": float(self.failures), "genrm/errors": float(self.errors),
                "genrm/latency_mean_s": sum(lat) / len(lat) if lat else 0.0,
                "genrm/latency_max_s": lat[-1] if lat else 0.0}


def parse_score(text: str, pattern: str, *, lo: float = 0.0, hi: float = 1.0) -> float | None:
    """The last match of ``pattern``'s first group in ``text`` as a float clipped to [lo, hi]; None if none."""
    found = re.findall(pattern, text)
    if not found:
        return None
    last = found[-1]
    try:
        return min(hi, max(lo, float(last[0] if isinstance(last, tuple) else last)))
    except ValueError:
        return None


class GenRM:
    """A batched async judge reward (see the module docstring)."""

    def __init__(self, generate: Callable[[list[list[int]]], Any], tokenizer: Any, *,
                 template: str = DEFAULT_TEMPLATE, pattern: str = DEFAULT_PATTERN, batch_size: int = 16,
                 max_concurrency: int = 2, timeout_s: float = 300.0, on_unparsed: float = 0.0,
                 chat_template: bool = True):
        for key in ("{response}",):
            if key not in template:
                raise ValueError(f"genrm template must contain {key}")
        re.compile(pattern)
        self.generate = generate
        self.is_async = is_async(generate)
        """``generate`` is a coroutine function (a judge on the caller's loop, :class:`EngineJudge`)."""
        self.max_concurrency = max_concurrency
        self.tokenizer = tokenizer
        self.template = template
        self.pattern = pattern
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.on_unparsed = on_unparsed
        self.chat_template = chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.stats = JudgeStats()
        self._sem = threading.BoundedSemaphore(max_concurrency)
        self._lock = threading.Lock()
        # its own threads: a call that timed out may still run; nothing waits for it to finish
        self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency + 2, thread_name_prefix="relax-genrm")

    def prompt_ids(self, response: str, answer: Any, meta: dict[str, Any] | None) -> list[int]:
        question = str((meta or {}).get("question", (meta or {}).get("prompt", "")))
        text = self.template.format(response=response, answer=answer, question=question)
        if self.chat_template:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
            return list(map(int, ids))
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def _call(self, prompts: list[list[int]]) -> tuple[list[str], float]:
        with self._sem:
            t0 = time.perf_counter()
            out = self.generate(prompts)
            return out, time.perf_counter() - t0

    async def _acall(self, sem: asyncio.Semaphore, prompts: list[list[int]]) -> tuple[list[str], float]:
        async with sem:
            t0 = time.perf_counter()
            out = await self.generate(prompts)
            return out, time.perf_counter() - t0

    def _calls(self, chunks: list[list[list[int]]]) -> list[Any]:
        """One bounded awaitable per chunk: on this loop (an async judge) or in the judge's threads."""
        if self.is_async:
            sem = asyncio.Semaphore(self.max_concurrency)
            return [asyncio.wait_for(self._acall(sem, c), self.timeout_s) for c in chunks]
        loop = asyncio.get_running_loop()
        return [asyncio.wait_for(loop.run_in_executor(self._pool, self._call, c), self.timeout_s) for c in chunks]

    async def score(self, responses: Sequence[str], answers: Sequence[Any],
                    metas: Sequence[dict[str, Any]] | None = None) -> list[float]:
        metas = list(metas) if metas is not None else [{}] * len(responses)
        prompts = [self.prompt_ids(r, a, m) for r, a, m in zip(responses, answers, metas, strict=True)]
        chunks = [prompts[k:k + self.batch_size] for k in range(0, len(prompts), self.batch_size)]
        results = await asyncio.gather(*self._calls(chunks), return_exceptions=True)
        scores: list[float] = []
        for chunk, res in zip(chunks, results, strict=True):
            with self._lock:
                self.stats.calls += 1
                self.stats.samples += len(chunk)
                if isinstance(res, BaseException):
                    self.stats.errors += len(chunk)
                    scores.extend([self.on_unparsed] * len(chunk))
                    continue
                texts, dt = res
                self.stats.latency_s.append(dt)
                for text in texts:
                    s = parse_score(text, self.pattern)
                    if s is None:
                        self.stats.failures += 1
                    scores.append(self.on_unparsed if s is None else s)
        return scores


def hf_judge(model_path: str, *, max_new_tokens: int = 64, temperature: float = 0.0, device: str = "cpu",
             seed: int = 0) -> tuple[Callable[[list[list[int]]], list[str]], Any]:
    """(generate, tokenizer) of a judge on the in-process ``hf`` engine: ``model_path`` is a local HF folder, or
    ``tiny`` (the built-in tiny Qwen3 with random weights, for tests)."""
    import torch

    from relax_hpc.config.schema import ModelConfig, SamplingConfig
    from relax_hpc.models.load import load_model, load_tokenizer
    from relax_hpc.rollout.hf_engine import HFEngine, sampling_params

    engine_sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens)

    mcfg = ModelConfig(path=model_path, **({"tokenizer": "builtin:bpe"} if model_path == "tiny" else {}))
    tok = load_tokenizer(mcfg)
    model = load_model(mcfg, tok, device=device, dtype=torch.float32, seed=seed).eval()
    engine = HFEngine(model, tok, SamplingConfig(temperature=temperature, max_new_tokens=max_new_tokens),
                      device=device, batch_prompts=64, decoder="generate", seed=seed)
    lock = threading.Lock()  # one batch at a time on one engine

    def generate(prompts: list[list[int]]) -> list[str]:
        from relax_hpc.rollout.engine import GenerateRequest, generate_all

        reqs = [GenerateRequest(f"genrm-{id(prompts)}-{k}", p, sampling_params(engine_sampling, 1))
                for k, p in enumerate(prompts)]
        with lock:
            results = asyncio.run(generate_all(engine, reqs))
        return [tok.decode(r.samples[0].token_ids, skip_special_tokens=True) for r in results]

    return generate, tok


class JudgeAborted(RuntimeError):
    """The engine kept aborting the judge's requests (paused for new weights each time)."""


class EngineJudge:
    """A judge on the rollout's own engine (``model: rollout``, see the module docstring): an async
    ``generate(prompts) -> texts`` for :class:`GenRM`, awaited on the loop the engine's requests run on."""

    def __init__(self, engine: Any, tokenizer: Any, *, name: str = "reward", max_new_tokens: int = 64,
                 temperature: float = 0.0, retries: int = 3):
        from relax_hpc.rollout.engine import SamplingParams

        self.engine, self.tokenizer, self.retries = engine, tokenizer, retries
        self.sampling = SamplingParams(n=1, temperature=temperature, max_new_tokens=max_new_tokens)
        self.prefix = f"{name}/genrm-{uuid.uuid4().hex[:6]}"
        self.requests = 0
        """Requests sent to the engine (aborted ones asked again count again)."""
        self.version = -1
        """The engine's weights version at the last verdicts."""
        self._aborts: set[asyncio.Task[Any]] = set()

    def _request(self, prompt: list[int]) -> Any:
        from relax_hpc.rollout.engine import GenerateRequest

        self.requests += 1
        return GenerateRequest(f"{self.prefix}-{self.requests}", list(prompt), self.sampling)

    async def __call__(self, prompts: list[list[int]]) -> list[str]:
        from relax_hpc.rollout.engine import generate_all

        texts: list[str | None] = [None] * len(prompts)
        todo = list(range(len(prompts)))
        for _ in range(self.retries + 1):
            reqs = [self._request(prompts[i]) for i in todo]
            try:
                results = await generate_all(self.engine, reqs)
            except asyncio.CancelledError:  # timed out (or the role stops): the engine drops them
                self._abort([r.request_id for r in reqs])
                raise
            again = []
            for i, res in zip(todo, results, strict=True):
                out = res.samples[0]
                if out.finish_reason == "abort":
                    again.append(i)
                else:
                    texts[i] = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                    self.version = int(out.versions.max()) if len(out.versions) else int(self.engine.version)
            todo = again
            if not todo:
                return [t or "" for t in texts]
        raise JudgeAborted(f"the engine aborted {len(todo)} judge requests {self.retries + 1} times")

    def _abort(self, request_ids: list[str]) -> None:
        """Abort ``request_ids`` on the engine in the background (nothing waits for it; bounded)."""
        task = asyncio.get_running_loop().create_task(asyncio.wait_for(self.engine.abort(request_ids), 10.0))
        self._aborts.add(task)
        task.add_done_callback(lambda t: (self._aborts.discard(t), t.cancelled() or t.exception()))


class ServerJudge:
    """A judge on a server engine (``sglang`` or ``vllm``) of its own: the server process serves ``model`` (a local
    HF folder, or ``tiny``: the built-in tiny Qwen3, random weights, for tests) with fixed weights, and
    :meth:`generate` sends a batch's prompts to it concurrently (the server batches them) from an event loop thread
    of the judge's. Its files (model folder, server record and log) go to ``workdir``, a run directory of its own:
    the judge never picks up the policy's weight snapshots."""

    def __init__(self, model: str, *, engine: str = "vllm", workdir: str | Path | None = None,
                 server: dict[str, Any] | None = None, max_new_tokens: int = 64, temperature: float = 0.0,
                 seed: int = 0, tiny: dict[str, Any] | None = None, start_timeout_s: float = 600.0):
        from relax_hpc.config.load import validate_dict
        from relax_hpc.events import EventLog
        from relax_hpc.models.load import load_tokenizer
        from relax_hpc.rollout.server import make_server_engine
        from relax_hpc.rundir import RunDir

        if engine not in ("sglang", "vllm"):
            raise ValueError(f"genrm engine {engine!r}: a server judge runs on sglang or vllm (hf: in-process)")
        mcfg: dict[str, Any] = {"path": model, "dtype": "float32"}
        if model == "tiny":
            mcfg.update(tokenizer="builtin:bpe", tiny={**TINY_SERVER_JUDGE, **(tiny or {})})
        self.cfg = validate_dict({
            "name": "genrm-judge", "mode": "fully_async", "model": mcfg, "seed": seed,
            "data": {"task": {"name": "reverse_digits"}},
            "rollout": {"engine": engine, "sampling": {"temperature": temperature, "max_new_tokens": max_new_tokens},
                        "server": {"weight_sync": "files", **(server or {})}}})
        root = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="relax-genrm-"))
        self.run_dir = RunDir.create(root, name="genrm-judge", resume=True)
        self.tokenizer = load_tokenizer(self.cfg.model)
        self.events = EventLog(self.run_dir, "rollout", 0)
        self.engine = make_server_engine(self.cfg, run_dir=self.run_dir, proc="genrm-0", device="cpu", seed=seed,
                                         tokenizer=self.tokenizer, events=self.events)
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="relax-genrm-loop", daemon=True)
        self._thread.start()
        self._calls = 0
        self._run(self.engine.ensure_started(), start_timeout_s)

    def _run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def generate(self, prompts: list[list[int]]) -> list[str]:
        """The judge's verdicts on ``prompts`` (one request each, all in flight at once)."""
        from relax_hpc.rollout.engine import GenerateRequest, SamplingParams, generate_all

        self._calls += 1
        sp = SamplingParams(temperature=self.temperature, max_new_tokens=self.max_new_tokens, n=1)
        reqs = [GenerateRequest(f"genrm-{self._calls}-{k}", p, sp) for k, p in enumerate(prompts)]
        timeout = self.cfg.rollout.server.request_timeout_s + 60
        results = self._run(generate_all(self.engine, reqs), timeout)
        return [self.tokenizer.decode(r.samples[0].token_ids, skip_special_tokens=True) for r in results]

    def close(self) -> None:
        """Stop the server process and the loop."""
        try:
            self._run(self.engine.close(), 120)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self.events.close()


TINY_SERVER_JUDGE = {"arch": "qwen3", "hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                     "intermediate_size": 256, "max_position": 512, "tie_embeddings": False}
"""The tiny judge's shape for server engines (vLLM's CPU backend takes head_dim 64, untied embeddings)."""

_JUDGES: dict[tuple[Any, ...], GenRM] = {}
_SERVERS: list[ServerJudge] = []


@batched
async def judge(responses: list[str], answers: list[Any], *, metas: list[dict[str, Any]] | None = None,
                context: RewardContext | None = None, model: str = "tiny", template: str = DEFAULT_TEMPLATE,
                pattern: str = DEFAULT_PATTERN, batch_size: int = 16, max_new_tokens: int = 64,
                timeout_s: float = 300.0, on_unparsed: float = 0.0, engine: str | None = None,
                server: dict[str, Any] | None = None, workdir: str | None = None, max_concurrency: int = 2,
                temperature: float = 0.0) -> list[dict[str, float]]:
    """The recipe-facing GenRM reward (``reward.name: relax_hpc.rewards.genrm:judge``): one judge per distinct
    settings, built at first use and kept; each value carries the judge's cumulative counters as metrics.
    ``model: rollout``: the rollout's own engine (:class:`EngineJudge`, through ``context``); else ``engine``:
    ``hf`` (default, in-process) or ``sglang`` / ``vllm`` (a server process of the judge's own,
    :class:`ServerJudge`; ``server``: its ``rollout.server`` settings, ``workdir``: where its files go)."""
    settings = dict(template=template, pattern=pattern, batch_size=batch_size, timeout_s=timeout_s,
                    on_unparsed=on_unparsed, max_concurrency=max_concurrency)
    if model == SHARED_ENGINE:
        rm = _rollout_judge(context, engine, settings, max_new_tokens=max_new_tokens, temperature=temperature)
    else:
        key = (model, template, pattern, batch_size, max_new_tokens, timeout_s, on_unparsed, engine,
               json.dumps(server, sort_keys=True), workdir, max_concurrency, temperature)
        if key not in _JUDGES:
            if engine in (None, "hf"):
                gen, tok = hf_judge(model, max_new_tokens=max_new_tokens, temperature=temperature)
            else:
                sj = ServerJudge(model, engine=engine, server=server, workdir=workdir, max_new_tokens=max_new_tokens,
                                 temperature=temperature)
                _SERVERS.append(sj)
                atexit.register(sj.close)
                gen, tok = sj.generate, sj.tokenizer
            _JUDGES[key] = GenRM(gen, tok, **settings)
        rm = _JUDGES[key]
    scores = await rm.score(responses, answers, metas)
    m = rm.stats.metrics()
    extra = {"genrm_calls": m["genrm/calls"], "genrm_failures": m["genrm/failures"], "genrm_errors": m["genrm/errors"],
             "genrm_latency_mean_s": m["genrm/latency_mean_s"]}
    if isinstance(rm.generate, EngineJudge):
        extra["genrm_version"] = float(rm.generate.version)
        m["genrm/version"] = extra["genrm_version"]
    if context is not None:
        context.metrics.update(m)  # logged with the rollout's batch metrics
    return [{"reward": s, **extra} for s in scores]


def _rollout_judge(context: RewardContext | None, engine: str | None, settings: dict[str, Any], *,
                   max_new_tokens: int, temperature: float) -> GenRM:
    """The judge on the rollout's engine, kept in the context's state (one per reward runner)."""
    if engine is not None:
        raise ValueError(f"genrm model: rollout judges on the rollout's own engine: leave out engine ({engine!r})")
    if context is None or context.engine is None or context.tokenizer is None:
        raise ValueError("genrm model: rollout needs the rollout's engine: this reward is not scored by a rollout "
                         "driver (colocate ranks and fully_async workers lend it theirs)")
    key = ("genrm", json.dumps(settings, sort_keys=True), max_new_tokens, temperature)
    if key not in context.state:
        gen = EngineJudge(context.engine, context.tokenizer, name=context.name, max_new_tokens=max_new_tokens,
                          temperature=temperature)
        context.state[key] = GenRM(gen, context.tokenizer, **settings)
    rm: GenRM = context.state[key]
    return rm
