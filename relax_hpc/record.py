"""The sample record: one rollout (prompt + response) with everything the trainer needs, from the engine's first
call to the packed micro-batch. One class, one set of field names, all the way:

    engine call (``SampleOutput``) -> :class:`Sample` (rollout driver, episodes; written to the store)
    -> HDF5 columns -> :class:`Sample` (read back) -> ``TrainItem`` (the sample plus its advantage)
    -> ``MicroBatch`` -> ``LossInputs``

(``docs/sample-path.md`` draws the path.) The rollout driver builds a sample from an engine call
(:meth:`Sample.from_output`), extends it with later calls (:meth:`Sample.extend`: a resubmitted abort, the next turn)
and with environment tokens (:meth:`Sample.append_context`), then sets its reward, versions and group; the store
writes it and reads it back as the same class; the trainer wraps it with its advantage.

Multimodal tensors (``pixel_values``, ``image_grid_thw``, ``input_features``, video frames ...) may be numpy arrays
or torch tensors (detected by duck typing; torch is never imported to read). Dtypes numpy lacks (``bfloat16``,
``float8_*``) are stored as their raw bits (``uint16`` / ``uint8``) with the logical dtype name recorded in
:attr:`Sample.tensor_dtypes`; :func:`to_torch` views the bits back.

This module imports numpy only (torch lazily, in :func:`to_torch`): every layer may use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from relax_hpc.errors import SampleValidationError

#: Logical dtypes numpy has no type for -> the unsigned type of the same width that carries their bits.
RAW_DTYPES: dict[str, type[np.unsignedinteger]] = {
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
    "float8_e4m3fnuz": np.uint8,
    "float8_e5m2fnuz": np.uint8,
}

_REQUIRED = ("prompt_ids", "response_ids", "logprobs", "reward")
_INT32, _FLOAT32, _UINT8 = np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.uint8)


def _typed(a: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """``a`` as ``dtype`` without a copy when it already is (the common case: no conversion call per sample)."""
    return a if a.dtype is dtype else a.astype(dtype, copy=False)


class EngineTokens(Protocol):
    """What one engine call returns for a sample (``relax_hpc.rollout.engine.SampleOutput``), as the record reads
    it (this module imports no layer above it)."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray
    timings: dict[str, float]

    @property
    def finish_reason(self) -> str: ...

    def mask(self) -> np.ndarray: ...


def _empty_ids() -> np.ndarray:
    return np.zeros(0, np.int32)


@dataclass(eq=False, slots=True)
class Sample:
    """One rollout. Token arrays are 1-D; ``logprobs``, ``loss_mask`` and ``versions`` have one entry per response
    token.

    On write ``loss_mask=None`` means "train on every response token" and ``version_first``/``version_last`` default
    to ``version``. On read every stored field is filled in and ``stale`` tells whether ``version`` is below the
    ``min_version`` the plan asked for (``stale_policy="flag"``). The fields after ``turns`` live while the sample is
    generated and are not stored (``versions`` is summarised by ``version_first``/``version_last``, the finish
    reason is kept in ``metadata``).
    """

    prompt_ids: np.ndarray = field(default_factory=_empty_ids)
    """Prompt token ids (integer dtype, stored as int32). A multi-turn sample carries its own (the environment's
    first messages with the tool section; a later point when the chat template is not prefix-preserving)."""
    response_ids: np.ndarray = field(default_factory=_empty_ids)
    """Response token ids, including tool/environment tokens of multi-turn rollouts."""
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    """Per response token log-probability under the rollout (sampling) policy, 0 on environment tokens (float32)."""
    reward: float = 0.0
    """The scalar reward used for the advantage (the reward function's, or a multi-turn episode's)."""
    loss_mask: np.ndarray | None = None
    """1 for tokens the policy generated, 0 for tool/environment tokens (stored as uint8)."""
    version: int = 0
    """Policy (weight snapshot) version of the sample: its oldest generated token's (staleness is counted from it)."""
    version_first: int | None = None
    """Oldest version used if the weights changed mid-generation (defaults to ``version``)."""
    version_last: int | None = None
    """Newest version used if the weights changed mid-generation (defaults to ``version``)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """The reward's named parts (``format``, ``env``, ``function`` ...), logged as ``reward/<name>``."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds spent per phase (``generate``, ``reward`` ...)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Any JSON-able data (finish reason, the prompt's row, an episode's counts ...)."""
    tensors: dict[str, Any] = field(default_factory=dict)
    """Named multimodal tensors of any shape: numpy arrays or torch tensors on write, numpy arrays on read."""
    tensor_dtypes: dict[str, str] = field(default_factory=dict)
    """Logical dtype name per tensor (on read always filled; on write only needed for raw ``bfloat16`` bits)."""
    group_id: str = ""
    """The prompt group (set by the rollout driver, stored with the group, filled in on read)."""
    stale: bool = False
    """On read: ``version < min_version`` of the plan (only ever True with ``stale_policy="flag"``)."""
    turns: np.ndarray | None = None
    """Multi-turn samples: ``[T, 2]`` (start, end) of each generated turn in ``response_ids`` (stored as int32 in
    the shard's ``turns`` column; ``0 <= start <= end <= len(response_ids)``, turns in order, not overlapping).
    None for single-turn samples and for samples of shards written before the column existed."""
    # ------------------------------------------------------------- while generating (not stored)
    versions: np.ndarray | None = None
    """[R] int32 weight version of each response token; -1 on tokens the engine did not generate. None on read."""
    finish_reason: str = ""
    """Of the last engine call: ``stop``, ``length`` or ``abort`` (stored in ``metadata``)."""
    engine_calls: int = 0
    """Engine calls that produced the response (more than one: resubmitted aborts, turns)."""

    # ----------------------------------------------------------------------------------------------- building
    @classmethod
    def from_output(cls, out: EngineTokens, prompt_ids: np.ndarray | None = None) -> Sample:
        """The sample of one engine call (its arrays are adopted, not copied)."""
        return cls(prompt_ids=_empty_ids() if prompt_ids is None else prompt_ids,
                   response_ids=_typed(out.token_ids, _INT32), logprobs=_typed(out.logprobs, _FLOAT32),
                   loss_mask=_typed(out.mask(), _UINT8), versions=_typed(out.versions, _INT32),
                   timings=dict(out.timings), finish_reason=out.finish_reason, engine_calls=1)

    def extend(self, out: EngineTokens) -> Sample:
        """Append the tokens of one more engine call (each keeps its version)."""
        self.response_ids = np.concatenate([self.response_ids, out.token_ids.astype(np.int32)])
        self.logprobs = np.concatenate([self.logprobs, out.logprobs.astype(np.float32)])
        self.versions = np.concatenate([self.token_versions(), out.versions.astype(np.int32)])
        self.loss_mask = np.concatenate([self.mask(), out.mask().astype(np.uint8)])
        self.finish_reason = out.finish_reason
        for k, v in out.timings.items():
            self.timings[k] = self.timings.get(k, 0.0) + v
        self.engine_calls += 1
        return self

    def append_context(self, token_ids: Sequence[int]) -> Sample:
        """Append tokens that came from elsewhere (tool output, the environment): not trained on, no version."""
        k = len(token_ids)
        self.response_ids = np.concatenate([self.response_ids, np.asarray(token_ids, dtype=np.int32)])
        self.logprobs = np.concatenate([self.logprobs, np.zeros(k, np.float32)])
        self.versions = np.concatenate([self.token_versions(), np.full(k, -1, np.int32)])
        self.loss_mask = np.concatenate([self.mask(), np.zeros(k, np.uint8)])
        return self

    # ----------------------------------------------------------------------------------------------- reading
    def mask(self) -> np.ndarray:
        """The loss mask (all ones when none was set)."""
        return self.loss_mask if self.loss_mask is not None else np.ones(len(self.response_ids), np.uint8)

    def token_versions(self) -> np.ndarray:
        """Per-token versions (``version`` on every token when none were recorded: a sample read from the store)."""
        if self.versions is not None:
            return self.versions
        return np.full(len(self.response_ids), self.version, np.int32)

    def version_range(self, default: int) -> tuple[int, int]:
        """(oldest, newest) version of the generated tokens; ``(default, default)`` if there are none."""
        v = self.versions
        if v is None or not len(v):
            return default, default
        lo = int(v.min())
        if lo < 0:  # context tokens (no version) among them
            v = v[v >= 0]
            if not len(v):
                return default, default
            lo = int(v.min())
        return lo, int(v.max())

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Build a sample from a plain dict; missing or unknown keys raise :class:`SampleValidationError`."""
        if not isinstance(data, dict):
            raise SampleValidationError(f"a sample must be a dict or a Sample, got {type(data).__name__}")
        missing = [k for k in _REQUIRED if k not in data]
        if missing:
            raise SampleValidationError(f"sample is missing required key(s): {', '.join(missing)}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise SampleValidationError(f"sample has unknown key(s): {', '.join(unknown)} (known: {sorted(known)})")
        return cls(**data)

    def torch_tensor(self, name: str) -> Any:
        """The multimodal tensor ``name`` as a torch tensor in its logical dtype (imports torch)."""
        arr = self.tensors[name]
        return to_torch(arr, self.tensor_dtypes.get(name, arr.dtype.name))

    def model_inputs(self) -> dict[str, Any]:
        """The multimodal tensors as torch tensors in their logical dtypes (the model's extra inputs)."""
        return {k: self.torch_tensor(k) if isinstance(v, np.ndarray) else v for k, v in self.tensors.items()}


def to_torch(array: np.ndarray, dtype_name: str | None = None) -> Any:
    """Turn a stored array into a torch tensor of logical dtype ``dtype_name`` (views raw bits, no copy)."""
    import torch

    tensor = torch.from_numpy(array if array.flags.c_contiguous else array.copy(order="C"))
    if dtype_name is None or dtype_name == array.dtype.name:
        return tensor
    if dtype_name in RAW_DTYPES:
        if array.dtype != RAW_DTYPES[dtype_name]:
            raise ValueError(
                f"{dtype_name} bits must be stored as {np.dtype(RAW_DTYPES[dtype_name]).name}, got {array.dtype.name}"
            )
        return tensor.view(getattr(torch, dtype_name))
    raise ValueError(f"cannot view a {array.dtype.name} array as {dtype_name}")


@dataclass(eq=False)
class SampleGroup:
    """The samples of one prompt. ``group_id`` must be unique within the run (e.g. ``<writer>:<n>``)."""

    group_id: str
    samples: list[Sample]
