"""Load a recipe: read YAML, apply ``--set key.path=value`` overrides, validate; one line per problem."""

from __future__ import annotations

import copy
import logging
import stat
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from relax_hpc.config.base import Variants, union_points, variants_of
from relax_hpc.config.schema import RecipeConfig
from relax_hpc.config.yamlsafe import MAX_RECIPE_BYTES, decode_recipe, load_yaml_text
from relax_hpc.errors import ConfigError

log = logging.getLogger(__name__)


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
    """Valid keys of the section at ``loc`` (pydantic's, with variant tags) for 'unknown key' messages."""
    cls: Any = model
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return None
        f = cls.model_fields[part]
        variants = variants_of(f.annotation, f.metadata)
        if variants is not None:
            cls = variants.models.get(parts.pop(0)) if parts else None
            continue
        ann = f.annotation
        args = getattr(ann, "__args__", ())
        sub = [a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)]
        cls = sub[0] if sub else None
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return sorted(cls.model_fields)
    return None


def _plain_loc(loc: tuple[Any, ...], points: dict[tuple[str, ...], Variants]
               ) -> tuple[tuple[Any, ...], Variants | None]:
    """``loc`` without its variant tags (``trainer.torch.megatron`` -> ``trainer.megatron``), and the variants of
    the section holding its last key (None where that section has none)."""
    out: list[Any] = []
    holder = None
    i = 0
    while i < len(loc):
        out.append(loc[i])
        i += 1
        v = points.get(tuple(out))
        if v is not None and i < len(loc) and loc[i] in v.models:
            i += 1  # the tag pydantic puts after a union
            holder = v if i == len(loc) - 1 else None
    return tuple(out), holder


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


def _variant_problem(err: Any, where: str, variants: Variants, section: Any) -> str | None:
    """The line for a key of a variant that is not selected (``trainer.megatron`` with ``backend: torch``)."""
    key = str(err["loc"][-1])
    owners = variants.owners(key)
    if err["type"] != "extra_forbidden" or not owners:
        return None
    base = where.rpartition(".")[0]
    chosen = variants.selected(section) if isinstance(section, dict) else variants.default
    return (f"{where}: only for {base}.{variants.key}: {' or '.join(owners)} (this recipe has {base}.{variants.key}: "
            f"{short_repr(chosen) if not isinstance(chosen, str) else chosen})")


def _section_at(data: Any, loc: tuple[Any, ...]) -> Any:
    """The input mapping at ``loc`` (plain keys), or None."""
    node = data
    for part in loc:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def format_validation_error(exc: ValidationError, model: type[BaseModel] = RecipeConfig,
                            data: Any = None) -> list[str]:
    """One line per problem: ``algorithm.lr: Input should be greater than 0 (got -1)``. ``data``: the validated
    input (names the selected variant when a key belongs to another)."""
    points = union_points(model)
    lines = []
    for err in exc.errors():
        loc, holder = _plain_loc(tuple(err["loc"]), points)
        where = ".".join(str(p) for p in loc) or "(recipe)"
        if err["type"] == "union_tag_invalid" and loc in points:
            v = points[loc]
            lines.append(f"{where}.{v.key}: Input should be {v.choices()} "
                         f"(got {short_repr(v.selected(err.get('input')))})")
            continue
        if holder is not None:
            line = _variant_problem(err, where, holder, _section_at(data, loc[:-1]))
            if line is not None:
                lines.append(line)
                continue
        if err["type"] == "extra_forbidden":
            valid = _fields_of(model, tuple(err["loc"])[:-1])
            hint = f"; valid keys: {', '.join(valid)}" if valid else ""
            lines.append(f"{where}: unknown key{hint}")
            continue
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if err["type"] == "model_type":
            msg = msg.partition(" or instance of ")[0]  # the class name is no key a user can write
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
        raise ConfigError(format_validation_error(exc, data=data)) from None


def validate_resolved(data: dict[str, Any]) -> RecipeConfig:
    """Validate a run dir's resolved config (``config.json``, written by :func:`config_to_json`). Versions before the
    variant sections wrote every variant's keys (``trainer.megatron`` of a torch run), which that run ignored; they
    are dropped here, so such run dirs resume with the settings they ran with. A key no variant has stays an
    error."""
    if isinstance(data, dict):
        data = copy.deepcopy(data)
        for loc, variants in union_points(RecipeConfig).items():
            section = _section_at(data, loc)
            model = variants.models.get(variants.tag_of(section)) if isinstance(section, dict) else None
            if model is None:
                continue
            for key in [k for k in section if k not in model.model_fields and variants.owners(k)]:
                del section[key]
    return validate_dict(data)


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


def drop_replaced_variants(recipe: dict[str, Any], merged: dict[str, Any], overrides: list[str]) -> list[str]:
    """Where an override selects another variant (``--set trainer.backend=torch`` on a megatron recipe), remove from
    ``merged`` the recipe file's keys that only the replaced variant has (``trainer.megatron``); keys the overrides
    set themselves stay, and are errors if the selected variant lacks them. The variant is chosen on the merged
    mapping, so ``--set trainer.backend=megatron --set trainer.megatron.tp=2`` works in either order. Returns one
    line per removed key (the caller warns)."""
    set_paths = [tuple(parse_override(o)[0]) for o in overrides]
    notes = []
    for loc, variants in union_points(RecipeConfig).items():
        before, after = _section_at(recipe, loc), _section_at(merged, loc)
        if not isinstance(before, dict) or not isinstance(after, dict):
            continue
        old, new = variants.tag_of(before), variants.tag_of(after)
        model = variants.models.get(new)
        if old == new or model is None:
            continue
        for key in [k for k in after if k in before and k not in model.model_fields]:
            path = (*loc, key)
            if any(p[:len(path)] == path or path[:len(p)] == p for p in set_paths):
                continue  # given on the command line: validated (and refused) as such
            del after[key]
            where = ".".join(loc)
            notes.append(f"{where}.{key} of the recipe dropped: only for {where}.{variants.key}: "
                         f"{' or '.join(variants.owners(key))}, which the overrides replaced by "
                         f"{variants.selected(after)}")
    return notes


def load_recipe(path: Path | str, overrides: list[str] | None = None) -> RecipeConfig:
    """Recipe file + overrides -> validated config. Raises :class:`ConfigError` (one line per problem). An override
    that selects another variant drops the file's keys of the replaced one, with a warning
    (:func:`drop_replaced_variants`)."""
    recipe = read_recipe_file(path)
    data = apply_overrides(recipe, overrides or [])
    for note in drop_replaced_variants(recipe, data, overrides or []):
        log.warning(note)
    return validate_dict(data)


def config_to_json(cfg: RecipeConfig) -> dict[str, Any]:
    """The resolved config as a JSON-able dict (written to the run dir)."""
    return cfg.model_dump(mode="json")
