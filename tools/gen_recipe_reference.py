"""Write docs/recipes.md: every recipe field with its type, default and docstring, from the schema itself.

    python tools/gen_recipe_reference.py          # rewrite docs/recipes.md
    python tools/gen_recipe_reference.py --check  # exit 1 if it is out of date (the tests run this)
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from relax_hpc.config.schema import RecipeConfig

OUT = Path(__file__).resolve().parents[1] / "docs" / "recipes.md"


def _type_name(ann: object) -> str:
    text = str(ann).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.replace("relax_hpc.config.schema.", "")


def _section(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    rows = []
    subs = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        sub = next((a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        key = f"{prefix}{name}"
        if sub is not None:
            subs.append((sub, f"{key}."))
            rows.append(f"| `{key}` | section | | {(f.description or '').replace(chr(10), ' ')} |")
            continue
        default = "required" if f.default is PydanticUndefined and f.default_factory is None else (
            repr(f.default_factory()) if f.default_factory is not None else repr(f.default))
        desc = (f.description or "").replace("\n", " ").replace("|", "\\|")
        rows.append(f"| `{key}` | `{_type_name(ann)}` | `{default}` | {desc} |")
    title = prefix.rstrip(".") or "top level"
    out += [f"## {title}", "", (model.__doc__ or "").strip(), "", "| key | type | default | meaning |",
            "| --- | --- | --- | --- |", *rows, ""]
    for sub, p in subs:
        _section(sub, p, out)


def render() -> str:
    out = ["# Recipe reference", "",
           "Generated from `relax_hpc/config/schema.py` by `python tools/gen_recipe_reference.py`. Precedence: "
           "`--set key.path=value` > the recipe file > these defaults. Unknown keys are errors.", ""]
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
