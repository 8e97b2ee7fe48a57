"""The supervised warm-up of an agentic recipe (``warmup.source: env``): the episode environment's
``warmup_examples(task, rng)`` on the data's prompts, rendered into tokens exactly as an episode renders its
context (chat template, the environment's tool schemas, ``rollout.env.chat_template_kwargs``, generation prompt)."""

from __future__ import annotations

import random
from typing import Any

from relax_hpc.config.schema import EnvConfig
from relax_hpc.envs.api import WarmsUp, WarmupExample, task_of
from relax_hpc.envs.registry import make_env
from relax_hpc.envs.tokens import Transcript
from relax_hpc.envs.tools import Tool
from relax_hpc.trainer.sft import WarmupPair, answer_ids


class EnvWarmupStream:
    """``next_batch(n)``: the :class:`WarmupPair` list of ``n`` data prompts (each prompt gives the environment's
    examples for its task)."""

    def __init__(self, env_cfg: EnvConfig, tokenizer: Any, prompts: Any, seed: int):
        self.cfg = env_cfg
        self.tokenizer = tokenizer
        self.prompts = prompts
        self.rng = random.Random(seed)

    def next_batch(self, n: int) -> list[WarmupPair]:
        out: list[WarmupPair] = []
        for prompt in self.prompts.next_batch(n):
            env = make_env(self.cfg.name, self.cfg.kwargs)
            tools = [Tool.from_callable(f).schema for f in env.tools()] or None
            assert isinstance(env, WarmsUp), "checked at validation (check_warmup_hook)"
            out += [self.pair(ex, tools) for ex in env.warmup_examples(task_of(prompt), self.rng)]
        return out

    def pair(self, ex: WarmupExample, tools: list[dict[str, Any]] | None) -> WarmupPair:
        context = Transcript(self.tokenizer, ex.messages, tools, dict(self.cfg.chat_template_kwargs)).prompt_ids
        return WarmupPair(context, answer_ids(self.tokenizer, ex.answer), weight=ex.weight)
