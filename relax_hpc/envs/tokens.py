"""Exact tokens across turns: the token sequence a multi-turn sample trains on is the one the model saw.

Generated tokens are kept as the engine returned them (never decoded and re-encoded). Only the environment's new
messages are tokenized: the conversation is rendered through the chat template without them (``before``) and with
them plus the generation prompt (``after``); if ``after`` starts with ``before`` and ``before`` contains the decoded
text of the last generated turn, the new tokens are the encoding of

    ``before[end of the generated text:]`` + ``after[len(before):]``

The first part is what the template puts after the model's end-of-turn token that the model did not generate
(Qwen's newline after ``<|im_end|>``; the end-of-turn token itself when the turn was cut at its length limit). A
template that is not prefix-preserving (it rewrites earlier turns: drops earlier reasoning, reformats a turn the
model wrote) fails that test; the sample then ends and a new one starts from the template's rendering of the whole
conversation (:meth:`Transcript.restart`), so no sample holds tokens in a context the model never saw.

Shapes of a finished sample (P prompt tokens, R response tokens, T generated turns):
    prompt_ids [P] int32 | response_ids, loss_mask (uint8), logprobs (float32), versions (int32) [R] | turns [T, 2]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax_hpc.envs.api import Message
from relax_hpc.record import Sample


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class Transcript:
    """The sample being built and the conversation it renders."""

    tokenizer: Any
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.messages = list(self.messages)
        text = self.render(self.messages, generation_prompt=True)
        self.prompt_ids = encode(self.tokenizer, text)
        # a tokenizer whose decode gives back the rendered text lets the whole stream be checked against the
        # template's rendering at every turn; a lossy one (whitespace dropped) only the last generated turn
        self._lossless = self._decode(self.prompt_ids) == text
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turns: list[tuple[int, int]] = []
        self._last_text = ""
        self.finish_reason = "stop"

    # -------------------------------------------------------------------------------------------- reading
    def render(self, messages: list[Message], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools or None, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **self.template_kwargs)

    @property
    def context_ids(self) -> list[int]:
        """What the model reads next: prompt + everything so far."""
        return self.prompt_ids + self.ids

    @property
    def total_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # -------------------------------------------------------------------------------------------- writing
    def add_turn(self, token_ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray, finish_reason: str) -> str:
        """Append a generated turn as is; returns its text (end-of-turn token removed) for the parser."""
        start = len(self.ids)
        self.ids += [int(t) for t in token_ids]
        self.mask += [1] * len(token_ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions]
        self.turns.append((start, len(self.ids)))
        self.finish_reason = finish_reason
        text = self._decode([int(t) for t in token_ids])
        self._last_text = text
        eos = self.tokenizer.eos_token
        content = text[:-len(eos)] if eos and text.endswith(eos) else text
        self.messages.append({"role": "assistant", "content": content})
        return content

    def add_env(self, messages: list[Message]) -> bool:
        """Append the environment's messages, tokenizing only them. False (nothing appended) when the template is
        not prefix-preserving here: call :meth:`restart`."""
        before = self.render(self.messages, generation_prompt=False)
        after = self.render(self.messages + messages, generation_prompt=True)
        if not after.startswith(before):
            return False
        if self._lossless:
            seen = self._decode(self.context_ids)
            if not before.startswith(seen):  # the template rewrote what the model saw
                return False
            end = len(seen)
        else:
            end = before.rfind(self._last_text) if self._last_text else len(before)
            if end < 0:  # the template rewrote the generated turn
                return False
            end += len(self._last_text)
        new = encode(self.tokenizer, before[end:] + after[len(before):])
        self.ids += new
        self.mask += [0] * len(new)
        self.logprobs += [0.0] * len(new)
        self.versions += [-1] * len(new)
        self.messages += messages
        self._last_text = ""
        return True

    def restart(self, messages: list[Message]) -> Transcript:
        """A new sample whose prompt is the template's rendering of the whole conversation plus ``messages``."""
        return Transcript(self.tokenizer, self.messages + messages, self.tools, self.template_kwargs)

    def sample(self) -> Sample:
        """The sample built so far (its reward is set once the episode is scored)."""
        turns = np.asarray(self.turns, dtype=np.int32).reshape(-1, 2)
        return Sample(
            prompt_ids=np.asarray(self.prompt_ids, dtype=np.int32), response_ids=np.asarray(self.ids, dtype=np.int32),
            loss_mask=np.asarray(self.mask, dtype=np.uint8), logprobs=np.asarray(self.logprobs, dtype=np.float32),
            versions=np.asarray(self.versions, dtype=np.int32), turns=turns, finish_reason=self.finish_reason)


def truncate_message(tokenizer: Any, message: Message, max_tokens: int, marker: str) -> tuple[Message, bool]:
    """Cut a message's text content to ``max_tokens`` tokens (``marker`` appended); True if it was cut."""
    content = message.get("content")
    if not isinstance(content, str):
        return message, False
    ids = encode(tokenizer, content)
    if len(ids) <= max_tokens:
        return message, False
    return {**message, "content": tokenizer.decode(ids[:max_tokens], skip_special_tokens=False) + marker}, True
