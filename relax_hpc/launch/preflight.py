"""Preflight: what a role would only find once started, checked by ``validate`` and ``submit`` before any process
starts or any run dir is created.

It opens the model's ``config.json``, loads the tokenizer (when it is not a built-in one), reads the first rows of
the data file (the whole file when it is small) and checks the prompt/answer keys, and checks that a ``cuda``
device can be had where the role will run. Each problem is one :class:`UserError` line.
"""

from __future__ import annotations

import json
import logging
import shutil
from itertools import islice
from pathlib import Path
from typing import Any

from relax_hpc.config.schema import DataConfig, DistillAlgorithmConfig, ModelConfig, RecipeConfig
from relax_hpc.errors import UserError

log = logging.getLogger(__name__)


class CannotRunHere(UserError):
    """A problem of the machine, not of the recipe: no GPU here, the data not made (or not mounted) yet. A refusal
    for a local run; a warning for ``validate --executor slurm`` and ``submit --dry-run`` (the job runs elsewhere)."""

PEEK_ROWS = 64
"""Rows of the data checked for the prompt and answer keys."""
FULL_READ_BYTES = 64 << 20
"""Data files up to this size are parsed whole (a malformed line anywhere is found); larger ones: the first rows."""


def resolve_executor(want: str) -> str:
    """``auto`` -> ``slurm`` when sbatch is on PATH, else ``local`` (no controller query: validate stays offline)."""
    if want != "auto":
        return want
    return "slurm" if shutil.which("sbatch") else "local"


def _is_local_path(name: str) -> bool:
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") != 1


def check_model_folder(path: str, where: str) -> None:
    """A local model folder must hold a readable ``config.json`` naming its ``model_type``."""
    if path == "tiny" or not _is_local_path(path):
        return
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise UserError(f"{where}: {folder} does not exist" if not folder.exists() else
                        f"{where}: {folder} is not a folder (an HF model folder holds config.json)")
    cfg_file = folder / "config.json"
    try:
        obj = json.loads(cfg_file.read_bytes())
    except FileNotFoundError:
        raise UserError(f"{where}: {folder} holds no config.json; not an HF model folder") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}: {cfg_file} is not readable JSON ({str(exc)[:200]})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("model_type"), str):
        raise UserError(f"{where}: {cfg_file} names no model_type; not an HF model config")


def _cached(repo: str) -> bool:
    """True if the HF hub cache holds ``repo``'s tokenizer config (so loading it needs no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo, "tokenizer_config.json"), str)


def check_tokenizer(model: ModelConfig) -> Any:
    """Load the tokenizer the roles will load (built-in ones are cheap; others are opened from disk)."""
    from relax_hpc.models.load import load_tokenizer

    name = model.tokenizer or model.path
    if unchecked_hub_name(model) is not None:
        return None
    try:
        return load_tokenizer(model)
    except UserError:
        raise
    except Exception as exc:  # transformers raises many types for a corrupt tokenizer folder
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise UserError(f"model.tokenizer: cannot load tokenizer {name!r} ({type(exc).__name__}: {first})") from None


def unchecked_hub_name(model: ModelConfig) -> str | None:
    """A warning when the model or tokenizer is a hub name this machine has not cached (its spelling cannot be
    checked offline), else None."""
    names = dict.fromkeys(n for n in (model.path, model.tokenizer or model.path) if n)
    for name in names:
        if not name.startswith("builtin:") and name != "tiny" and not _is_local_path(name) and not _cached(name):
            return (f"model: {name!r} is a hub name not in this machine's cache, so it is not checked (a misspelt "
                    "name fails only when the roles download it; for nodes without internet see docs/cluster.md)")
    return None


def missing_data(path: str) -> str:
    """The line for a ``data.path`` that does not exist: where it was looked for and how the data is made."""
    from relax_hpc.data.make import data_hint

    p = Path(path).expanduser()
    where = f"data.path: {p.resolve() if not p.is_absolute() else p} does not exist"
    if not p.is_absolute():  # recipe paths are made absolute against the recipe's folder; this one came from --set
        where += (f" (a relative path given with --set is taken from the current directory, {Path.cwd()}; "
                  "relative paths in the recipe from the recipe's folder)")
    hint = data_hint(p.resolve())
    return f"{where}; {hint}" if hint else where


def _first_rows(path: str) -> list[Any]:
    from relax_hpc.data import sources

    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".jsonl" and p.stat().st_size > FULL_READ_BYTES:
        rows = []
        with p.open(encoding="utf-8", errors="strict") as f:
            for lineno, line in enumerate(islice(f, PEEK_ROWS * 4), 1):
                if line.strip():
                    try:
                        obj = json.loads(line)
                    except ValueError as exc:
                        raise UserError(f"{p}:{lineno}: not valid JSON ({exc})") from None
                    rows.append(sources.Row(obj, f"{p}:{lineno}", p.parent))
        return rows
    try:
        return sources.read_rows(p)
    except UnicodeDecodeError as exc:
        raise UserError(f"data.path: {p} is not UTF-8 text (byte offset {exc.start})") from None


def check_data(data: DataConfig, tokenizer: Any) -> None:
    """The data file exists, holds rows, and its first rows have the prompt and answer keys."""
    if data.path is None:
        return
    from relax_hpc.data.dataset import row_field

    if not Path(data.path).expanduser().exists():
        raise CannotRunHere(missing_data(data.path))
    rows = _first_rows(data.path)
    if not rows:
        raise UserError(f"data.path: {data.path} holds no rows")
    for row in rows[:PEEK_ROWS]:
        if not isinstance(row.fields, dict):
            raise UserError(f"{row.origin}: a row must be a JSON object")
        row_field(row, data.prompt_key, "data.prompt_key")
        row_field(row, data.answer_key, "data.answer_key")
    if data.chat_template and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise UserError("data.chat_template is true but the tokenizer has no chat template; "
                        "set data.chat_template: false to tokenize raw text")


def check_devices(cfg: RecipeConfig, executor: str) -> None:
    """``device: cuda`` needs GPUs: on Slurm in the role's resources, locally on this machine. A role that trains
    generates (if it does) with the trainer's model, on ``trainer.device`` (a server engine: on its server's
    ``rollout.device``); a role that only generates uses ``rollout.device``."""
    from relax_hpc.config.schema import ServerRolloutBase
    from relax_hpc.roles.spec import mode_spec

    in_process = not isinstance(cfg.rollout, ServerRolloutBase)
    for spec in mode_spec(cfg).roles:
        section = "trainer" if spec.trains else "rollout"
        if spec.trains and spec.generates and in_process and cfg.rollout.device == "cuda" and \
                cfg.trainer.device == "cpu":
            raise UserError(f"rollout.device is cuda but {cfg.mode} generates with the trainer's model, which "
                            "trainer.device puts on the cpu; set trainer.device: cuda (or rollout.device: auto)")
        if getattr(cfg, section).device != "cuda":
            continue
        res = spec.resources
        if executor == "slurm":
            if getattr(cfg.launch, res).gpus_per_node < 1:
                raise UserError(f"{section}.device is cuda but launch.{res}.gpus_per_node is 0: the {spec.noun} "
                                f"would get no GPU; set launch.{res}.gpus_per_node")
            continue
        import torch

        if not torch.cuda.is_available():
            raise CannotRunHere(f"{section}.device is cuda but this machine has no CUDA device (local executor); use "
                            f"device: auto or cpu, or run on Slurm with GPUs")


def preflight(cfg: RecipeConfig, *, executor: str, lenient: bool = False) -> list[str]:
    """Every check above, in order of cost. Raises :class:`UserError` (one line) on the first problem; with
    ``lenient``, a :class:`CannotRunHere` problem is returned as a warning instead (the job runs elsewhere).
    Returns the warnings (a hub name that cannot be checked offline, and those problems)."""
    warnings: list[str] = []

    def soft(check: Any, *args: Any) -> Any:
        try:
            return check(*args)
        except CannotRunHere as exc:
            if not lenient:
                raise
            warnings.append(f"cannot run on this machine: {exc}")
            return None

    soft(check_devices, cfg, resolve_executor(executor))
    check_model_folder(cfg.model.path, "model.path")
    if isinstance(cfg.algorithm, DistillAlgorithmConfig):
        teacher = cfg.algorithm.distill.teacher
        if not teacher:
            raise UserError("algorithm.name is distill but algorithm.distill.teacher is not set (a model path, or "
                            "`tiny` for a tiny teacher)")
        check_model_folder(teacher, "algorithm.distill.teacher")
    builtin = cfg.model.path == "tiny" and not cfg.model.tokenizer
    tokenizer = None if builtin and cfg.data.path is None else check_tokenizer(cfg.model)
    hub = unchecked_hub_name(cfg.model)
    if hub is not None:
        warnings.append(hub)
    soft(check_data, cfg.data, tokenizer)
    return warnings


GROUP_ALGORITHMS = ("grpo", "gspo", "sapo")
"""Algorithms whose advantage is the reward relative to the prompt's group."""


def _context_length(model: ModelConfig) -> int | None:
    if model.path == "tiny":
        return model.tiny.max_position
    try:
        obj = json.loads((Path(model.path).expanduser() / "config.json").read_bytes())
    except (OSError, ValueError):
        return None
    obj = obj.get("text_config", obj) if isinstance(obj, dict) else {}
    value = obj.get("max_position_embeddings") if isinstance(obj, dict) else None
    return value if isinstance(value, int) else None


def start_warnings(cfg: RecipeConfig) -> list[str]:
    """Settings that make a run learn nothing or learn from cut responses (printed, not refused)."""
    out = []
    a = cfg.algorithm
    if cfg.rollout.n_samples == 1 and a.name in GROUP_ALGORITHMS:
        out.append(f"rollout.n_samples is 1: {a.name}'s group advantage is 0 for every sample, so nothing is "
                   "learned; use n_samples >= 2")
    if isinstance(a, DistillAlgorithmConfig) and a.distill.coef == 0 and a.distill.reward_coef == 0:
        out.append("algorithm.distill.coef and reward_coef are both 0: every advantage is 0")
    context = _context_length(cfg.model)
    task = cfg.data.task if cfg.data.path is None else None
    prompt = task.max_len + 4 if task is not None else cfg.data.max_prompt_tokens
    new = cfg.rollout.sampling.max_new_tokens
    if context is not None and prompt + new > context:
        what = "the task's prompts (~" if task is not None else "prompts up to data.max_prompt_tokens ("
        out.append(f"{what}{prompt} tokens) plus rollout.sampling.max_new_tokens ({new}) exceed the model's "
                   f"context length ({context}): responses will be cut by the context, not by the model")
    return out
