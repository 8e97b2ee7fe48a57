"""Validation of samples on their way into a shard: :func:`check_sample` (one sample, any accepted input) and
:func:`check_columns` (a whole shard field by field, the common case), giving the stored dtypes and the JSON part.

The sample itself is :class:`relax_hpc.record.Sample` (re-exported here and from :mod:`relax_hpc.store`): the store
writes it and reads it back as the same class.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from relax_hpc.errors import SampleValidationError
from relax_hpc.record import RAW_DTYPES, Sample, SampleGroup, to_torch

__all__ = ["RAW_DTYPES", "CheckedColumns", "CheckedSample", "Sample", "SampleGroup", "check_columns", "check_sample",
           "ones_mask", "tensor_to_numpy", "to_torch"]

NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,127}$")


@dataclass(slots=True)
class CheckedSample:
    """A sample after validation: arrays in their stored dtypes, the JSON part encoded."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    loss_mask: np.ndarray
    logprobs: np.ndarray
    reward: float
    version: int
    version_first: int
    version_last: int
    doc: dict[str, Any]
    """The JSON part: ``{"r": rewards, "t": timings, "m": metadata}`` (empty entries left out)."""
    tensors: dict[str, tuple[np.ndarray, str]]
    turns: np.ndarray | None = None
    """``[T, 2]`` int32 turn boundaries, or None."""


def _int_array(value: Any, name: str, where: str) -> np.ndarray:
    if value is None:
        raise SampleValidationError(f"{where}: required field '{name}' is missing")
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.ndim != 1:
        raise SampleValidationError(f"{where}: field '{name}' must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
        raise SampleValidationError(f"{where}: field '{name}' must hold integer token ids, got dtype {arr.dtype}")
    return arr


def _number(value: Any, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SampleValidationError(f"{where}: field '{name}' must be a number, got {type(value).__name__}")
    return float(value)


def _number_dict(value: Any, name: str, where: str) -> dict[str, float]:
    if not isinstance(value, dict):
        raise SampleValidationError(f"{where}: field '{name}' must be a dict of name -> number")
    out = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise SampleValidationError(f"{where}: field '{name}' has a non-string key {k!r}")
        out[k] = _number(v, f"{name}[{k!r}]", where)
    return out


def _version(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise SampleValidationError(f"{where}: field '{name}' must be an integer >= 0, got {value!r}")
    return int(value)


def tensor_to_numpy(value: Any, declared: str | None, name: str, where: str) -> tuple[np.ndarray, str]:
    """A multimodal tensor as (contiguous storage array, logical dtype name). Accepts numpy or torch (duck typed)."""
    if isinstance(value, np.generic):  # a numpy scalar: a 0-d tensor
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        arr, logical = value, value.dtype.name
        if logical in RAW_DTYPES:  # ml_dtypes.bfloat16 and friends
            arr = arr.view(RAW_DTYPES[logical])
        elif declared is not None and declared != logical:
            raw = RAW_DTYPES.get(declared)
            if raw is None or arr.dtype != raw:
                raise SampleValidationError(f"{where}: tensor '{name}' is {logical} but tensor_dtypes says {declared}")
            logical = declared
    elif hasattr(value, "detach") and hasattr(value, "numpy") and hasattr(value, "dtype"):
        tensor = value.detach()
        if hasattr(tensor, "cpu"):
            tensor = tensor.cpu()
        logical = str(tensor.dtype).removeprefix("torch.")
        if logical in RAW_DTYPES:
            import torch

            tensor = tensor.contiguous().view(getattr(torch, np.dtype(RAW_DTYPES[logical]).name))
        arr = tensor.contiguous().numpy()
    else:
        raise SampleValidationError(
            f"{where}: tensor '{name}' must be a numpy array or a torch tensor, got {type(value).__name__}"
        )
    if arr.dtype.kind not in "biuf":
        raise SampleValidationError(f"{where}: tensor '{name}' has unsupported dtype {arr.dtype}")
    if arr.dtype.kind == "b":
        arr = arr.view(np.uint8)
    return (arr if arr.flags.c_contiguous else arr.copy(order="C")), logical


_ONES = np.ones(0, np.uint8)


def ones_mask(n: int) -> np.ndarray:
    """A read-only all-ones uint8 mask of length ``n`` (a view of one shared buffer: never write to it)."""
    global _ONES
    if n > _ONES.shape[0]:
        _ONES = np.ones(max(n, 2 * _ONES.shape[0], 4096), np.uint8)
        _ONES.flags.writeable = False
    return _ONES[:n]


@dataclass(slots=True)
class CheckedColumns:
    """The samples of a shard after validation, field by field (what :class:`CheckedSample` holds, as lists)."""

    prompt_ids: list[np.ndarray]
    response_ids: list[np.ndarray]
    loss_mask: list[np.ndarray]
    logprobs: list[np.ndarray]
    reward: list[float]
    version: list[int]
    version_first: list[int]
    version_last: list[int]
    doc: list[dict[str, Any]]
    tensors: list[dict[str, tuple[np.ndarray, str]]]
    turns: list[np.ndarray | None]

    @classmethod
    def of(cls, checked: list[CheckedSample]) -> CheckedColumns:
        return cls(*([getattr(c, f.name) for c in checked] for f in fields(cls)))


def check_columns(samples: list[Any]) -> CheckedColumns | None:
    """:func:`check_sample` for every sample of a shard at once, field by field, for the common case: numpy token
    and log-prob arrays, Python numbers, plain dicts of floats, no tensors. None for anything else: then check sample
    by sample, which accepts the same samples (and more) or names the problem. Never accepts what that rejects."""
    if {type(s) for s in samples} != {Sample} or [s for s in samples if s.tensors or s.turns is not None]:
        return None
    nd = np.ndarray
    prompts = [s.prompt_ids for s in samples]
    responses = [s.response_ids for s in samples]
    logprobs = [s.logprobs for s in samples]
    arrays = prompts + responses
    if {type(a) for a in arrays} | {type(a) for a in logprobs} != {nd} or {a.ndim for a in arrays} != {1}:
        return None
    if not {a.dtype.kind for a in arrays} <= {"i", "u"} or {a.dtype.kind for a in logprobs} != {"f"}:
        return None
    lengths = [a.shape[0] for a in responses]
    if [a.shape for a in logprobs] != [(n,) for n in lengths]:
        return None
    masks = [s.loss_mask for s in samples]
    given = [m for m in masks if m is not None]
    if given and (
        {type(m) for m in given} != {nd}
        or not {m.dtype.kind for m in given} <= {"b", "i", "u"}
        or [m.shape for m in given] != [(n,) for m, n in zip(masks, lengths) if m is not None]
    ):
        return None
    ones = ones_mask(max(lengths))
    masks = [ones[:n] if m is None else m for m, n in zip(masks, lengths)]
    rewards = [s.reward for s in samples]
    versions = [s.version for s in samples]
    firsts = [v if (f := s.version_first) is None else f for s, v in zip(samples, versions)]
    lasts = [v if (f := s.version_last) is None else f for s, v in zip(samples, versions)]
    if {type(r) for r in rewards} != {float} or {type(v) for v in versions + firsts + lasts} != {int}:
        return None
    if min(versions + firsts) < 0 or any(map(operator.gt, firsts, lasts)):
        return None
    docs = _docs(samples)
    if docs is None:
        return None
    tensors: list[dict[str, tuple[np.ndarray, str]]] = [{} for _ in samples]
    return CheckedColumns(prompts, responses, masks, logprobs, rewards, versions, firsts, lasts, docs, tensors,
                          [None] * len(samples))


def _docs(samples: list[Sample]) -> list[dict[str, Any]] | None:
    """The JSON part of each sample, if every ``rewards``/``timings`` is a dict of str -> float and every
    ``metadata`` a dict (None otherwise)."""
    rewards = [s.rewards for s in samples]
    timings = [s.timings for s in samples]
    metadata = [s.metadata for s in samples]
    numbers = [d for d in rewards + timings if d]
    if not {type(d) for d in numbers} <= {dict} or not {type(d) for d in metadata if d} <= {dict}:
        return None
    if not {type(k) for d in numbers for k in d} <= {str}:
        return None
    if not {type(v) for d in numbers for v in d.values()} <= {float}:
        return None
    docs: list[dict[str, Any]] = [{} for _ in samples]
    for doc, r, t, m in zip(docs, rewards, timings, metadata):
        if r:
            doc["r"] = r
        if t:
            doc["t"] = t
        if m:
            doc["m"] = m
    return docs


def check_sample(sample: Sample | dict[str, Any], where: str) -> CheckedSample:
    """Validate one sample (dtypes, shapes, types); raises :class:`SampleValidationError` naming the field.

    Value-range checks (token ids fit int32, mask is 0/1) and JSON encoding run later, once per shard or group.
    """
    if isinstance(sample, dict):
        sample = Sample.from_dict(sample)
    elif not isinstance(sample, Sample):
        raise SampleValidationError(f"{where}: expected a Sample or dict, got {type(sample).__name__}")
    prompt = _int_array(sample.prompt_ids, "prompt_ids", where)
    response = _int_array(sample.response_ids, "response_ids", where)
    n = response.shape[0]
    if sample.logprobs is None:
        raise SampleValidationError(f"{where}: required field 'logprobs' is missing")
    logprobs = sample.logprobs if isinstance(sample.logprobs, np.ndarray) else np.asarray(sample.logprobs)
    if logprobs.dtype.kind != "f" and not (logprobs.size == 0 and logprobs.dtype.kind in "iu"):
        raise SampleValidationError(f"{where}: field 'logprobs' must be floating point, got dtype {logprobs.dtype}")
    if logprobs.shape != (n,):
        raise SampleValidationError(
            f"{where}: field 'logprobs' has shape {logprobs.shape}, expected ({n},) (one per response token)"
        )
    if sample.loss_mask is None:
        mask = ones_mask(n)
    else:
        mask = sample.loss_mask if isinstance(sample.loss_mask, np.ndarray) else np.asarray(sample.loss_mask)
        if mask.dtype.kind not in "biu":
            raise SampleValidationError(f"{where}: field 'loss_mask' must be bool or integer, got dtype {mask.dtype}")
        if mask.shape != (n,):
            raise SampleValidationError(
                f"{where}: field 'loss_mask' has shape {mask.shape}, expected ({n},) (one per response token)"
            )
    reward = _number(sample.reward, "reward", where)
    version = _version(sample.version, "version", where)
    first = version if sample.version_first is None else _version(sample.version_first, "version_first", where)
    last = version if sample.version_last is None else _version(sample.version_last, "version_last", where)
    if first > last:
        raise SampleValidationError(f"{where}: version_first ({first}) > version_last ({last})")
    doc: dict[str, Any] = {}
    if sample.rewards:
        doc["r"] = _number_dict(sample.rewards, "rewards", where)
    if sample.timings:
        doc["t"] = _number_dict(sample.timings, "timings", where)
    if sample.metadata:
        if not isinstance(sample.metadata, dict):
            raise SampleValidationError(f"{where}: field 'metadata' must be a dict")
        doc["m"] = sample.metadata
    tensors: dict[str, tuple[np.ndarray, str]] = {}
    if sample.tensors:
        if not isinstance(sample.tensors, dict):
            raise SampleValidationError(f"{where}: field 'tensors' must be a dict of name -> array")
        declared = sample.tensor_dtypes or {}
        for tname, value in sample.tensors.items():
            if not isinstance(tname, str) or not NAME_RE.match(tname):
                raise SampleValidationError(f"{where}: tensor name {tname!r} must match {NAME_RE.pattern}")
            tensors[tname] = tensor_to_numpy(value, declared.get(tname), tname, where)
    turns = None if sample.turns is None else _turns(sample.turns, n, where)
    return CheckedSample(prompt, response, mask, logprobs, reward, version, first, last, doc, tensors, turns)


def _turns(value: Any, n: int, where: str) -> np.ndarray:
    """Turn boundaries as a ``[T, 2]`` int32 array of ordered, non-overlapping ranges inside ``[0, n]``."""
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.size == 0:
        arr = arr.reshape(0, 2)
    if arr.ndim != 2 or arr.shape[1] != 2 or arr.dtype.kind not in "iu":
        raise SampleValidationError(
            f"{where}: field 'turns' must be a [T, 2] integer array of (start, end), got {arr.dtype} {arr.shape}"
        )
    flat = arr.reshape(-1).astype(np.int64)
    if flat.size and (flat[0] < 0 or flat[-1] > n or bool((np.diff(flat) < 0).any())):
        raise SampleValidationError(
            f"{where}: field 'turns' must hold ordered, non-overlapping (start, end) ranges within the {n} "
            f"response tokens, got {arr.tolist()}"
        )
    return arr.astype(np.int32, copy=False)
