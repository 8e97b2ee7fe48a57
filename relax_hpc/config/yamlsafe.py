"""Read recipe YAML defensively: one short error line for text that is not UTF-8, nesting too deep to parse,
duplicate keys (YAML would keep the last one silently), alias trees that expand hugely, and oversized files.

PyYAML's safe loader does the parsing; this module only adds limits around it (no YAML code of its own).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from relax_hpc.errors import ConfigError

MAX_RECIPE_BYTES = 1 << 20
"""Largest recipe file read (1 MiB: recipes hold settings, not data)."""
MAX_DEPTH = 64
"""Deepest nesting of mappings/sequences accepted."""
MAX_NODES = 200_000
"""Most YAML nodes a recipe may expand to once aliases are followed (an alias bomb expands to billions)."""


def decode_recipe(raw: bytes, path: Path | str) -> str:
    """The recipe's text; a file that is not UTF-8 (UTF-16, binary) is one error line saying so."""
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")) or (len(raw) > 1 and (raw[0] == 0 or raw[1] == 0)):
        raise ConfigError(f"{path}: the recipe is UTF-16 (or binary); save it as UTF-8")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                          "save the recipe as UTF-8") from None
    if "\x00" in text:
        raise ConfigError(f"{path}: the recipe holds NUL characters; it is not a text file")
    return text


def _mark(node: yaml.Node) -> str:
    m = node.start_mark
    return f"line {m.line + 1}, column {m.column + 1}"


def _check_tree(root: yaml.Node, where: str) -> None:
    """Refuse duplicate keys, nesting deeper than MAX_DEPTH and expansions past MAX_NODES (iteratively)."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, int, bool]] = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"{where}: {_mark(node)}: nested deeper than {MAX_DEPTH} levels")
        if isinstance(node, yaml.ScalarNode) or (id(node) in sizes and not done):
            sizes.setdefault(id(node), 1)
            continue
        children = ([c for kv in node.value for c in kv] if isinstance(node, yaml.MappingNode)
                    else list(node.value))
        if done:
            total = 1 + sum(sizes.get(id(c), 1) for c in children)
            if total > MAX_NODES:
                raise ConfigError(f"{where}: {_mark(node)}: YAML aliases expand to more than {MAX_NODES} nodes")
            sizes[id(node)] = total
            continue
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Node] = {}
            for key, _ in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    if key.value in seen:
                        raise ConfigError(f"{where}: {_mark(key)}: duplicate key {key.value[:80]!r} (first at "
                                          f"{_mark(seen[key.value])}); YAML would keep only the last one")
                    seen[key.value] = key
        stack.append((node, depth, True))
        stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)


def load_yaml_text(text: str, *, where: str) -> Any:
    """Parse one YAML document with the safe loader, within the limits above; :class:`ConfigError` otherwise."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" line {mark.line + 1}, column {mark.column + 1}:" if mark else ""
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(f"{where}:{at} malformed YAML: {str(problem)[:200]}") from None
        except RecursionError:
            raise ConfigError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
        if node is None:
            return None
        _check_tree(node, where)
        try:
            return loader.construct_document(node)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: malformed YAML: {str(exc).splitlines()[0][:200]}") from None
        except RecursionError:
            raise ConfigError(f"{where}: nested deeper than {MAX_DEPTH} levels") from None
    finally:
        loader.dispose()
