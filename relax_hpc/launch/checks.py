"""The checks of a recipe that need the building blocks: every plugin it names resolved and checked (the algorithm,
the reward function and its keyword arguments, the environment, its tool parser and, for ``warmup.source: env``,
its warm-up hook) and its extra Slurm parameters checked against the sbatch renderer's.

The schema (:mod:`relax_hpc.config`) checks a recipe's shape and imports none of the code it names; the entry points
that start, resume or render a run (``validate``, ``submit``, ``render``, ``sweep``, ``resume``, ``eval``) call
:func:`check_plugins` after it, so a misspelt name or a reward that cannot take its ``kwargs`` is one error line
before anything starts, not a failure mid-run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_hpc.config.load import load_recipe, short_repr
from relax_hpc.config.schema import RecipeConfig
from relax_hpc.errors import ConfigError


def plugin_problems(cfg: RecipeConfig) -> list[str]:
    """One line per plugin of ``cfg`` that does not resolve or check (``reward: ...``, ``algorithm.name: ...``)."""
    from relax_hpc.algorithms.registry import check_algorithm_name
    from relax_hpc.launch.slurm_params import check_slurm_params
    from relax_hpc.rewards.registry import check_reward

    problems: list[str] = []

    def check(where: str | None, fn: Callable[..., Any], *args: Any, got: Any = None) -> None:
        try:
            fn(*args)
        except ValueError as exc:  # a UserError is a ValueError too
            msg = str(exc)
            shown = "" if got is None or str(got)[:20] in msg else f" (got {short_repr(got)})"
            problems.append(f"{where}: {msg}{shown}" if where else msg)

    check("algorithm.name", check_algorithm_name, cfg.algorithm.name, got=cfg.algorithm.name)
    check("reward", check_reward, cfg.reward.name, cfg.reward.kwargs)
    env = cfg.rollout.env
    if env is not None:
        check("rollout.env", _check_env, env.name, env.kwargs, env.tool_parser)
        if cfg.warmup.source == "env" and cfg.warmup.steps:
            from relax_hpc.envs.registry import check_warmup_hook

            check(None, check_warmup_hook, env.name)  # its message names warmup.source
    for role, resources in (("trainer", cfg.launch.trainer), ("rollout", cfg.launch.rollout)):
        if resources.slurm:
            check(f"launch.{role}.slurm", check_slurm_params, resources.slurm)
    return problems


def _check_env(name: str, kwargs: dict[str, Any], tool_parser: str) -> None:
    from relax_hpc.envs.parsers import resolve_parser
    from relax_hpc.envs.registry import check_env

    check_env(name, kwargs)
    resolve_parser(tool_parser)


def check_plugins(cfg: RecipeConfig) -> RecipeConfig:
    """``cfg`` if every plugin it names checks; else :class:`ConfigError` with one line per problem."""
    problems = plugin_problems(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def load_checked(path: Path | str, overrides: list[str] | None = None) -> RecipeConfig:
    """:func:`~relax_hpc.config.load.load_recipe`, then :func:`check_plugins`."""
    return check_plugins(load_recipe(path, overrides))
