"""Load a recipe: read YAML, apply ``--set key.path=value`` overrides, validate; one line per problem."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.errors import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """``algorithm.lr=1e-6`` -> (["algorithm", "lr"], 1e-06). The value is parsed as a YAML scalar/flow value."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.path=value")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in parts):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``key.path=value`` set (creating intermediate mappings)."""
    out = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(parts[:-1])} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def _fields_of(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str] | None:
    """Valid keys of the section at ``loc`` (for 'unknown key' messages)."""
    cls: Any = model
    for part in loc:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return None
        ann = cls.model_fields[part].annotation
        args = getattr(ann, "__args__", ())
        sub = [a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)]
        cls = sub[0] if sub else None
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return sorted(cls.model_fields)
    return None


def format_validation_error(exc: ValidationError, model: type[BaseModel] = RecipeConfig) -> list[str]:
    """One line per problem: ``algorithm.lr: Input should be greater than 0 (got -1)``."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        where = ".".join(str(p) for p in loc) or "(recipe)"
        if err["type"] == "extra_forbidden":
            valid = _fields_of(model, loc[:-1])
            hint = f"; valid keys: {', '.join(valid)}" if valid else ""
            lines.append(f"{where}: unknown key{hint}")
            continue
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        got = err.get("input")
        suffix = f" (got {got!r})" if err["type"] not in ("missing",) and not isinstance(got, dict) else ""
        lines.append(f"{where}: {msg}{suffix}")
    return lines


def validate_dict(data: dict[str, Any]) -> RecipeConfig:
    """Validate a recipe mapping; raise :class:`ConfigError` with one line per problem."""
    if not isinstance(data, dict):
        raise ConfigError(f"a recipe must be a mapping of sections, got {type(data).__name__}")
    try:
        return RecipeConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def read_recipe_file(path: Path | str) -> dict[str, Any]:
    """Read a recipe YAML file into a mapping (relative data paths are resolved against its folder)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}:{where}: malformed YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections")
    data_section = data.get("data")
    if isinstance(data_section, dict) and isinstance(data_section.get("path"), str):
        p = Path(data_section["path"]).expanduser()
        if not p.is_absolute():
            data_section["path"] = str((path.parent / p).resolve())
    reward = data.get("reward")
    if isinstance(reward, dict) and isinstance(reward.get("name"), str):
        mod, sep, fn = reward["name"].rpartition(":")
        if sep and mod.endswith(".py") and not Path(mod).expanduser().is_absolute():
            reward["name"] = f"{(path.parent / mod).resolve()}:{fn}"
    return data


def load_recipe(path: Path | str, overrides: list[str] | None = None) -> RecipeConfig:
    """Recipe file + overrides -> validated config. Raises :class:`ConfigError` (one line per problem)."""
    data = apply_overrides(read_recipe_file(path), overrides or [])
    return validate_dict(data)


def config_to_json(cfg: RecipeConfig) -> dict[str, Any]:
    """The resolved config as a JSON-able dict (written to the run dir)."""
    return cfg.model_dump(mode="json")
