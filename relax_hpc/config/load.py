"""Load a recipe: read YAML, apply ``--set key.path=value`` overrides, validate; one line per problem."""

from __future__ import annotations

import copy
import stat
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.config.yamlsafe import MAX_RECIPE_BYTES, decode_recipe, load_yaml_text
from relax_hpc.errors import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """``algorithm.lr=1e-6`` -> (["algorithm", "lr"], 1e-06). The value is parsed as a YAML scalar/flow value."""
    if "=" not in text:
        raise ConfigError(f"override {short_repr(text)} is not of the form key.path=value")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in parts):
        raise ConfigError(f"override {short_repr(text)} has an empty key")
    try:
        value = load_yaml_text(raw, where=f"override {short_repr(key)}") if raw.strip() else ""
    except ConfigError:
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
                raise ConfigError(f"override {short_repr(text)}: {'.'.join(parts[:-1])} is not a section")
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


ECHO_CAP = 200
"""Longest echo of a user's value in an error line (a 5 MB scalar must not come back as a 5 MB message)."""


def short_repr(value: Any, cap: int = ECHO_CAP) -> str:
    """``repr(value)`` cut to ``cap`` characters (with the full length said)."""
    if isinstance(value, (str, bytes)) and len(value) > cap:
        return f"{value[:cap]!r}... ({len(value)} chars)"
    text = reprlib_repr(value)
    return text if len(text) <= cap else f"{text[:cap]}..."


def reprlib_repr(value: Any) -> str:
    """A repr that never builds a huge string for a huge container (an expanded YAML alias tree)."""
    import reprlib

    r = reprlib.Repr()
    r.maxstring = r.maxother = ECHO_CAP + 10
    r.maxlist = r.maxdict = r.maxtuple = r.maxset = 12
    r.maxlevel = 4
    return r.repr(value)


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
        echoed = str(got)[:20] in msg  # the validator's message already shows the value
        suffix = (f" (got {short_repr(got)})" if err["type"] not in ("missing",) and not isinstance(got, dict)
                  and not echoed else "")
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
    """Read a recipe YAML file into a mapping (relative data paths, ``data.path`` and ``eval.data.path``, are
    resolved against its folder)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError as exc:
        why = "does not exist" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc.strerror or exc})"
        raise ConfigError(f"recipe {short_repr(str(path))} {why}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"recipe {path} is a folder, not a YAML file")
    try:
        size = st.st_size
        if size > MAX_RECIPE_BYTES:
            raise ConfigError(f"{path}: {size} bytes is too large for a recipe (at most {MAX_RECIPE_BYTES}); "
                              "recipes hold settings, data belongs in data.path")
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read recipe {path}: {exc.strerror or exc}") from None
    data = load_yaml_text(decode_recipe(raw, path), where=str(path)) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections")
    held_out = data.get("eval")
    for data_section in (data.get("data"), held_out.get("data") if isinstance(held_out, dict) else None):
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
