"""Write docs/recipes.md: every recipe field with its type, default and docstring, from the schema itself.

    python tools/gen_recipe_reference.py          # rewrite docs/recipes.md
    python tools/gen_recipe_reference.py --check  # exit 1 if it is out of date (the tests run this)
"""

from __future__ import annotations

import inspect
import re
import sys
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from relax_hpc.config.base import Variants, variants_of
from relax_hpc.config.schema import RecipeConfig

OUT = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"


def _type_name(ann: object) -> str:
    text = str(ann).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return re.sub(r"relax_hpc\.config\.[a-z_]+\.", "", text)


def _row(key: str, f: FieldInfo) -> str:
    default = "required" if f.default is PydanticUndefined and f.default_factory is None else (
        repr(f.default_factory()) if f.default_factory is not None else repr(f.default))  # type: ignore[call-arg]
    desc = (f.description or "").replace("\n", " ").replace("|", "\\|")
    return f"| `{key}` | `{_type_name(f.annotation)}` | `{default}` | {desc} |"


def _table(fields: dict[str, FieldInfo], prefix: str, subs: list[tuple[type[BaseModel], str]]) -> list[str]:
    """The rows of ``fields``; sections become one row each and are added to ``subs`` (rendered after)."""
    rows = []
    for name, f in fields.items():
        key = f"{prefix}{name}"
        ann = f.annotation
        variants = variants_of(ann, f.metadata)
        sub = next((a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        desc = (f.description or "").replace(chr(10), " ")
        if variants is not None:
            subs.append((variants, f"{key}."))  # type: ignore[arg-type]
            rows.append(f"| `{key}` | section, by `{variants.key}`: {', '.join(variants.models)} | | {desc} |")
        elif sub is not None:
            subs.append((sub, f"{key}."))
            rows.append(f"| `{key}` | section | | {desc} |")
        else:
            rows.append(_row(key, f))
    return rows


def _header(title: str, doc: str | None) -> list[str]:
    return [f"## {title}", "", inspect.cleandoc(doc or ""), "", "| key | type | default | meaning |",
            "| --- | --- | --- | --- |"]


def _section(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    subs: list[tuple[type[BaseModel], str]] = []
    rows = _table(dict(model.model_fields), prefix, subs)
    out += [*_header(prefix.rstrip(".") or "top level", model.__doc__), *rows, ""]
    _subsections(subs, out)


def _subsections(subs: list[tuple[type[BaseModel], str]], out: list[str]) -> None:
    for sub, p in dict((p, (sub, p)) for sub, p in subs).values():  # a section two variants share: once
        if isinstance(sub, Variants):
            _variants(sub, p, out)
        else:
            _section(sub, p, out)


def _variants(variants: Variants, prefix: str, out: list[str]) -> None:
    """A section with variants: the keys every variant has (under its base's docstring), then each variant's own."""
    models = list(variants.models.values())
    base = next(c for c in models[0].__mro__ if all(issubclass(m, c) for m in models))
    common = {n: f for n, f in base.model_fields.items() if all(n in m.model_fields for m in models)}
    subs: list[tuple[type[BaseModel], str]] = []
    out += [*_header(prefix.rstrip("."), base.__doc__), *_table(common, prefix, subs), ""]
    for tag, model in variants.models.items():
        own = {n: f for n, f in model.model_fields.items() if n not in common}
        title = f"{prefix.rstrip('.')} ({variants.key}: {tag})"
        if own:
            out += [*_header(title, model.__doc__), *_table(own, prefix, subs), ""]
        else:
            out += [f"## {title}", "", inspect.cleandoc(model.__doc__ or ""), "", "No keys besides the ones above.", ""]
    _subsections(subs, out)


def render() -> str:
    out = ["# Recipe reference", "",
           "Generated from `relax_hpc/config/schema.py` (one module per section under `relax_hpc/config/`) by "
           "`python tools/gen_recipe_reference.py`. Precedence: `--set key.path=value` > the recipe file > these "
           "defaults. Unknown keys are errors. The `trainer`, `rollout` and `algorithm` sections have variants, "
           "selected by `trainer.backend`, `rollout.engine` and `algorithm.name`: a key of a variant that is not "
           "selected is an error too. A `--set` that selects another variant drops the recipe file's keys of the "
           "replaced one, with a warning.", ""]
    _section(RecipeConfig, "", out)
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python tools/gen_recipe_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
