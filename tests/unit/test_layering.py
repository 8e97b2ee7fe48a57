"""Lower layers never import higher ones: checked by walking every import (module level and lazy, inside
functions) of every module of relax_hpc with ``ast``.

Layers, low to high: the building blocks (store, weights, trainer, rollout, algorithms, data, models, rewards) <
the role loops (modes) < the role entry (roles) < launchers, CLI, benchmarks. The monitor's sinks are used by
the role loops; the role table (roles/spec.py) is plain data every layer above the building blocks may read.
``lifecycle``, ``rundir``, ``fsio``, ``events``, ``errors``, ``config`` are shared by all.

Below the role loops the order is strict (:data:`ORDER`): a building block imports only lower ones, never a peer of
its own layer, and the shared modules import none of them (:func:`up_arrows`). And no module imports, directly or
through others, a module that imports it (:func:`circles`; ``TYPE_CHECKING`` imports count: they are what a reader
follows too). What is still allowed is listed with its reason (:data:`KNOWN_UP`, :data:`KNOWN_CIRCLES`); an entry
whose import is gone fails its test, so the lists only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

import relax_hpc

PKG = Path(relax_hpc.__file__).resolve().parent

LOWER = ("store", "weights", "trainer", "rollout", "algorithms", "data", "models", "rewards")
RULES: dict[str, tuple[str, ...]] = {
    **{low: ("modes", "launch", "cli", "monitor", "bench", "roles") for low in LOWER},
    # modes may build monitor sinks (metrics) and read the role table; never launchers, the CLI or benchmarks
    "modes": ("launch", "cli", "bench"),
    "rollout": ("modes", "launch", "cli", "monitor", "bench", "roles", "trainer"),  # peers: rollout feeds the trainer
    "lifecycle": ("modes", "launch", "cli", "monitor", "bench", "roles"),
}
"""package -> packages it must never import."""

ROLE_TABLE_MAY_NOT_IMPORT = ("modes", "launch", "cli", "monitor", "bench")
"""roles/spec.py is read by the launchers and the monitor: it names the loops by import path, imported lazily."""

KNOWN: set[tuple[str, str]] = {
    # Known violations being fixed right now (issue 10); remove each entry with its fix, which makes this test
    # fail until then if the import comes back.
}
"""(file, imported module) pairs allowed for now."""


def module_name(path: Path, pkg: Path = PKG) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, pkg: Path = PKG) -> list[str]:
    """Every relax_hpc module ``path`` imports, anywhere in the file (relative imports resolved)."""
    mod = module_name(path, pkg)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            out.append(target)
            if target == "relax_hpc":  # `from relax_hpc import launch` imports a layer by name
                out += [f"{target}.{a.name}" for a in node.names]
    return [m for m in out if m == "relax_hpc" or m.startswith("relax_hpc.")]


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(pkg: Path = PKG) -> list[str]:
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg.parent).as_posix()
        own = layer(module_name(path, pkg))
        forbidden = RULES.get(own, ())
        if rel == "relax_hpc/roles/spec.py":
            forbidden = ROLE_TABLE_MAY_NOT_IMPORT
        for target in imports(path, pkg):
            if layer(target) in forbidden and (rel, target) not in KNOWN and \
                    not any(rel == f and target.startswith(t + ".") for f, t in KNOWN):
                bad.append(f"{rel} imports {target} ({own} must not import {layer(target)})")
    return sorted(set(bad))


def test_lower_layers_never_import_higher_ones() -> None:
    bad = violations()
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_known_violations_still_exist() -> None:
    """An allow-list entry whose import is gone must be removed, so the rule is tightened as fixes land."""
    for rel, target in KNOWN:
        assert target in imports(PKG.parent / rel), f"{rel} no longer imports {target}: drop it from KNOWN"


def test_the_walk_sees_lazy_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself, on a package tree of its own: imports inside functions and relative imports count, and
    modes importing launch is caught."""
    pkg = tmp_path / "relax_hpc"
    for sub in ("store", "modes"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "store" / "probe.py").write_text(
        "import os\n\ndef f():\n    from relax_hpc.launch import slurm\n    from ..modes import colocate\n"
        "    import relax_hpc.cli\n    from relax_hpc import monitor\n    from . import shard\n")
    (pkg / "modes" / "loop.py").write_text("from relax_hpc.launch.signals import StopFlag\nfrom ..store import x\n")
    found = violations(pkg)
    assert found == [
        "relax_hpc/modes/loop.py imports relax_hpc.launch.signals (modes must not import launch)",
        "relax_hpc/store/probe.py imports relax_hpc.cli (store must not import cli)",
        "relax_hpc/store/probe.py imports relax_hpc.launch (store must not import launch)",
        "relax_hpc/store/probe.py imports relax_hpc.modes (store must not import modes)",
        "relax_hpc/store/probe.py imports relax_hpc.monitor (store must not import monitor)",
    ], found


def test_no_function_in_modes_is_over_60_statements() -> None:
    """The mode loops stay short enough to read at a glance: every function (nested statements counted) in
    ``relax_hpc/modes`` has at most 60 statements."""
    sizes = {}
    for path in sorted((PKG / "modes").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                sizes[f"{path.name}:{node.name}"] = sum(isinstance(x, ast.stmt) for x in ast.walk(node)) - 1
    assert len(sizes) > 50, "the walk must see the modes' functions"
    assert max(sizes.values()) <= 60, {k: v for k, v in sizes.items() if v > 60}


# ------------------------------------------------------------------------------------------ circles and up-arrows
FOUNDATION = ("relax_hpc", "__version__", "errors", "fsio", "rundir", "events", "lifecycle", "timing", "plugins",
              "health", "rendezvous", "config", "record")
"""Shared by every layer; they import nothing of the building blocks or above."""

ORDER: tuple[tuple[str, ...], ...] = (
    FOUNDATION,
    ("store", "weights"),
    ("data",),
    ("models",),
    ("algorithms",),
    ("trainer", "rollout"),
    ("rewards",),
    ("envs",),
    ("weights.transport",),
)
"""The building blocks, low to high: a module imports only its own layer's packages or lower ones (packages of one
layer are peers and do not import each other). ``weights.transport`` is the seam between the trainer and the
rollout side (it knows both); the role loops (modes) and everything above use the rules of :data:`RULES`."""

KNOWN_UP: dict[tuple[str, str], str] = {}
"""(file or package folder, imported module) -> why this up-arrow is allowed for now; each must still exist (the
test below), so the list only shrinks. Empty: the schema checks no names against the registries (the entry points
call relax_hpc.launch.checks after it) and the preflight lives with the launchers (relax_hpc.launch.preflight)."""


def known_up(rel: str, target: str) -> bool:
    return any((rel == src or rel.startswith(src + "/")) and target == t for src, t in KNOWN_UP)


def block(module: str) -> str:
    """The layer name of ``module`` for :data:`ORDER` (``weights.transport`` apart from the rest of weights)."""
    parts = module.split(".")
    if parts[1:3] == ["weights", "transport"]:
        return "weights.transport"
    return parts[1] if len(parts) > 1 else parts[0]


def rank_of(name: str) -> int | None:
    return next((i for i, names in enumerate(ORDER) if name in names), None)


def up_arrows(pkg: Path = PKG) -> list[str]:
    """Imports from a building block (or the foundation) to a higher one or to a peer of its layer."""
    bad = []
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(pkg.parent).as_posix()
        own = block(module_name(path, pkg))
        mine = rank_of(own)
        if mine is None:
            continue
        for target in imports(path, pkg):
            theirs, other = rank_of(block(target)), block(target)
            if other == own or known_up(rel, target):
                continue
            higher = theirs is None or theirs > mine
            if higher or (theirs == mine and mine > 0):
                how = "a higher layer" if higher else "a peer"
                bad.append(f"{rel} imports {target} ({own} must not import {other}: {how})")
    return sorted(set(bad))


def module_graph(pkg: Path = PKG) -> dict[str, set[str]]:
    """Module -> the relax_hpc modules it imports (``from a import b`` names ``a.b`` when that is a module)."""
    paths = {module_name(p, pkg): p for p in sorted(pkg.rglob("*.py"))}
    graph: dict[str, set[str]] = {m: set() for m in paths}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    head = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*head, node.module] if node.module else head)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            for t in targets:
                while t and t not in paths:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def circles(pkg: Path = PKG) -> list[list[str]]:
    """The import circles: strongly connected groups of more than one module (Tarjan), each sorted."""
    graph = module_graph(pkg)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


KNOWN_CIRCLES: list[list[str]] = []
"""Circles allowed for now, each with the reason it is still there; each must still exist (the test below), so
the list only shrinks."""


def test_no_import_circles() -> None:
    found = [c for c in circles() if c not in KNOWN_CIRCLES]
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_known_circles_still_exist() -> None:
    now = circles()
    for c in KNOWN_CIRCLES:
        assert c in now, f"{c} is no longer a circle: drop it from KNOWN_CIRCLES"


def test_no_arrow_from_a_lower_layer_up() -> None:
    bad = up_arrows()
    assert not bad, "imports from a lower layer up:\n" + "\n".join(bad)


def test_known_up_arrows_still_exist() -> None:
    for src, target in KNOWN_UP:
        path = PKG.parent / src
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        assert any(target in imports(f) for f in files), f"{src} no longer imports {target}: drop it from KNOWN_UP"


def test_the_checkers_see_circles_and_up_arrows(tmp_path: Path) -> None:
    """Both checkers on a package tree of their own: a lazy circle between two modules and a package that imports
    its own submodule's user, an import from store up to rollout, and from rollout to its peer trainer."""
    pkg = tmp_path / "relax_hpc"
    for sub in ("store", "rollout", "trainer"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "store" / "a.py").write_text("def f():\n    from relax_hpc.store import b\n")
    (pkg / "store" / "b.py").write_text("from . import a\n")
    (pkg / "store" / "c.py").write_text("from relax_hpc.rollout.engine import Engine\n")
    (pkg / "rollout" / "engine.py").write_text("def g():\n    from relax_hpc.trainer import batch\n")
    (pkg / "trainer" / "batch.py").write_text("import relax_hpc.store.a\n")
    assert circles(pkg) == [["relax_hpc.store.a", "relax_hpc.store.b"]], circles(pkg)
    assert up_arrows(pkg) == [
        "relax_hpc/rollout/engine.py imports relax_hpc.trainer (rollout must not import trainer: a peer)",
        "relax_hpc/store/c.py imports relax_hpc.rollout.engine (store must not import rollout: a higher layer)",
    ], up_arrows(pkg)
