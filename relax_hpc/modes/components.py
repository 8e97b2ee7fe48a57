"""Build what a role needs from the resolved config, dispatched once: tokenizer, models, algorithm, rewards, data."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

from relax_hpc.config.checks import check_backends
from relax_hpc.config.schema import RecipeConfig

__all__ = ["check_backends"]

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


@dataclass
class Policy:
    """The policy model, its tokenizer, and where it runs."""

    model: Any
    tokenizer: Any
    device: str
    dtype: Any


def build_policy(cfg: RecipeConfig, *, device_pref: str) -> Policy:
    from relax_hpc.models.load import load_model, load_tokenizer, resolve_device, resolve_dtype

    device = resolve_device(device_pref)
    dtype = resolve_dtype(cfg.model.dtype, device)
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, device=device, dtype=dtype)
    return Policy(model=model, tokenizer=tok, device=device, dtype=dtype)


def build_aux_models(cfg: RecipeConfig, policy: Policy) -> tuple[Any, Any]:
    """(reference model or None, teacher model or None), frozen."""
    import copy

    from relax_hpc.config.schema import ModelConfig
    from relax_hpc.models.load import load_model

    ref = teacher = None
    if cfg.algorithm.kl_coef > 0:
        ref = copy.deepcopy(policy.model).eval().requires_grad_(False)
    d = cfg.algorithm.distill
    if cfg.algorithm.name == "distill":
        if not d.teacher:
            from relax_hpc.errors import ConfigError

            raise ConfigError("algorithm.distill.teacher: required when algorithm.name is distill")
        tcfg = ModelConfig(path=d.teacher, tiny=cfg.model.tiny, tokenizer=cfg.model.tokenizer)
        teacher = load_model(tcfg, policy.tokenizer, device=policy.device, dtype=policy.dtype).eval()
        teacher.requires_grad_(False)
    return ref, teacher


def build_engine(cfg: RecipeConfig, policy: Policy, *, seed: int = 0) -> Any:
    from relax_hpc.rollout.engine import make_engine

    return make_engine(cfg.rollout.engine, model=policy.model, tokenizer=policy.tokenizer,
                       sampling=cfg.rollout.sampling, device=policy.device, batch_prompts=cfg.rollout.batch_prompts,
                       seed=seed, decoder=cfg.rollout.hf_decoder)


def build_algorithm(cfg: RecipeConfig) -> Any:
    from relax_hpc.algorithms.registry import get_algorithm

    return get_algorithm(cfg.algorithm.name)


def build_prompt_stream(cfg: RecipeConfig, tokenizer: Any, *, seed_offset: int = 0) -> Any:
    from relax_hpc.data import PromptDataset, make_stream
    from relax_hpc.models.multimodal import build_preprocessor

    mm = build_preprocessor(cfg.model, tokenizer)
    return make_stream(PromptDataset(cfg.data, tokenizer, seed=cfg.seed + seed_offset, multimodal=mm))


def build_reward_runner(cfg: RecipeConfig) -> Any:
    from relax_hpc.rewards import RewardRunner

    return RewardRunner(cfg.reward)
