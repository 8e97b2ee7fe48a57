"""Build what a role needs from the resolved config, dispatched once: tokenizer, models, algorithm, rewards, data."""

from __future__ import annotations

import gc
import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from relax_hpc.config.schema import DistillAlgorithmConfig, RecipeConfig
from relax_hpc.trainer.checks import check_backends

if TYPE_CHECKING:
    from torch import dtype as TorchDtype
    from torch.nn import Module

    from relax_hpc.algorithms.base import Algorithm
    from relax_hpc.data.pool import PrefetchingStream
    from relax_hpc.data.stream import PromptStream
    from relax_hpc.envs.driver_episode import EnvEpisode
    from relax_hpc.rewards.runner import RewardRunner
    from relax_hpc.rollout.engine import RolloutEngine

__all__ = ["check_backends"]

Tokenizer = Any
"""A HF tokenizer (``transformers.PreTrainedTokenizerBase``) or the built-in digits tokenizer of the tiny model."""

log = logging.getLogger(__name__)


YOUNG_GC_THRESHOLD = 20_000
"""Net allocations between two collections of the youngest generation in a role's loop (Python's default: 700)."""


def settle_gc() -> None:
    """Before a role's loop: move everything allocated so far (~400k objects of torch/transformers) out of the
    collector (a full collection took ~0.5 s, GIL held), and collect the youngest generation every
    :data:`YOUNG_GC_THRESHOLD` net allocations. A demo step has ~2,000 short-lived objects alive at its peak (samples,
    trajectories, their dicts): at the default 700 it ran ~3 young collections a step over them (~0.3 ms of a 50 ms
    colocate step); objects freed by reference counting never reach a collection either way."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, older, oldest)


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


@dataclass
class Policy:
    """The policy model, its tokenizer, and where it runs."""

    model: Module
    tokenizer: Tokenizer
    device: str
    dtype: TorchDtype


def build_policy(cfg: RecipeConfig, *, device_pref: str) -> Policy:
    from relax_hpc.models.load import load_model, load_tokenizer, resolve_device, resolve_dtype

    device = resolve_device(device_pref)
    dtype = resolve_dtype(cfg.model.dtype, device)
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, device=device, dtype=dtype)
    return Policy(model=model, tokenizer=tok, device=device, dtype=dtype)


def build_aux_models(cfg: RecipeConfig, policy: Policy) -> tuple[Module | None, Module | None]:
    """(reference model or None, teacher model or None), frozen."""
    import copy

    from relax_hpc.config.schema import ModelConfig
    from relax_hpc.models.load import load_model

    ref = teacher = None
    if cfg.algorithm.kl_coef > 0:
        ref = copy.deepcopy(policy.model).eval().requires_grad_(False)
    if isinstance(cfg.algorithm, DistillAlgorithmConfig):  # the only variant with a teacher
        d = cfg.algorithm.distill
        if not d.teacher:
            from relax_hpc.errors import ConfigError

            raise ConfigError("algorithm.distill.teacher: required when algorithm.name is distill")
        tcfg = ModelConfig(path=d.teacher, tiny=cfg.model.tiny, tokenizer=cfg.model.tokenizer)
        teacher = load_model(tcfg, policy.tokenizer, device=policy.device, dtype=policy.dtype).eval()
        teacher.requires_grad_(False)
    return ref, teacher


def build_engine(cfg: RecipeConfig, tokenizer: Tokenizer, *, seed: int, model: Module | None = None,
                 device: str | None = None, colocated: bool = False, **server: Any) -> RolloutEngine:
    """The recipe's rollout engine: on ``model`` (colocate: the trainer's module, shared) or, with None, on weights
    of its own loaded from ``cfg.model`` (a fully_async worker holds no model; ``colocated``: the colocate engine
    of a trainer with no module to share). ``server``: ``run_dir``, ``proc``, ``events`` for the server engines."""
    from relax_hpc.rollout.factory import make_engine

    return make_engine(cfg, device=device, seed=seed, tokenizer=tokenizer, model=model, colocated=colocated,
                       **server)


def worker_seeds(cfg: RecipeConfig, rank: int, incarnation: int) -> tuple[int, int]:
    """(sampling seed, prompt-stream seed offset) of rollout worker ``rank`` in its ``incarnation``-th start: fixed
    by the recipe seed, so a run is reproducible; distinct per worker and per restart, so no two streams repeat."""
    return cfg.seed + 7919 * (rank + 1) + 104_729 * incarnation, 1000 * (rank + 1) + 100_003 * incarnation


def build_algorithm(cfg: RecipeConfig) -> Algorithm:
    from relax_hpc.algorithms.registry import get_algorithm

    return get_algorithm(cfg.algorithm.name)


def build_prompt_stream(cfg: RecipeConfig, tokenizer: Tokenizer, *, seed_offset: int = 0) -> PromptStream:
    from relax_hpc.data import PromptDataset, make_stream
    from relax_hpc.models.multimodal import build_preprocessor

    mm = build_preprocessor(cfg.model, tokenizer)
    return make_stream(PromptDataset(cfg.data, tokenizer, seed=cfg.seed + seed_offset, multimodal=mm))


def build_rollout_stream(cfg: RecipeConfig, tokenizer: Tokenizer, *,
                         seed_offset: int = 0) -> PromptStream | PrefetchingStream:
    """The prompt stream a rollout takes its batches from, dispatched once on ``data.media.pool_size``: 0 makes the
    media tensors inline when a batch is taken (a :class:`~relax_hpc.data.stream.PromptStream`); more starts that
    many preprocessing workers (:class:`~relax_hpc.data.pool.ProcessorPool`) behind a
    :class:`~relax_hpc.data.pool.PrefetchingStream` that keeps ``prefetch_batches`` batches prepared ahead. Both
    have ``next_batch``, ``state``/``load_state`` (the same positions), ``stats`` and ``close``."""
    stream = build_prompt_stream(cfg, tokenizer, seed_offset=seed_offset)
    media = cfg.data.media
    if media.pool_size == 0 or stream.dataset.multimodal is None:
        return stream
    from relax_hpc.data.pool import PrefetchingStream, ProcessorPool

    pool = ProcessorPool(stream.dataset.multimodal, media.pool_size, item_timeout_s=media.item_timeout_s)
    log.info("data: %d media preprocessing workers, %d batches prefetched", media.pool_size, media.prefetch_batches)
    return PrefetchingStream(stream, pool, prefetch_batches=media.prefetch_batches, owns_pool=True,
                             wait_timeout_s=2 * media.item_timeout_s + 300.0)


def build_episode(cfg: RecipeConfig, tokenizer: Tokenizer) -> EnvEpisode | None:
    """The driver's episode: multi-turn environment episodes for ``rollout.env``, else None (single turn)."""
    if cfg.rollout.env is None:
        return None
    from relax_hpc.envs.driver_episode import EnvEpisode

    return EnvEpisode(cfg, tokenizer)


def build_reward_runner(cfg: RecipeConfig, *, engine: RolloutEngine | None = None, tokenizer: Tokenizer = None,
                        name: str = "reward") -> RewardRunner:
    """The reward runner; ``engine`` and ``tokenizer`` (the rollout's) go to a reward that takes a ``context`` (a
    GenRM judge on the policy's own engine: ``reward.kwargs.model: rollout``)."""
    from relax_hpc.rewards import RewardRunner
    from relax_hpc.rewards.api import RewardContext

    return RewardRunner(cfg.reward, RewardContext(engine=engine, tokenizer=tokenizer, name=name))
