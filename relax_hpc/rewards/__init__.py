"""Rewards: the function interface (sync/async, single/batched, dict-valued), built-ins and the batch runner."""

from relax_hpc.rewards.api import batched, is_async, is_batched
from relax_hpc.rewards.registry import BUILTIN, check_reward, resolve_reward
from relax_hpc.rewards.runner import RewardResult, RewardRunner

__all__ = ["BUILTIN", "RewardResult", "RewardRunner", "batched", "check_reward", "is_async", "is_batched",
           "resolve_reward"]
