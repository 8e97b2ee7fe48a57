"""Lower layers never import higher ones: checked by walking every import (module level and lazy, inside
functions) of every module of relax_hpc with ``ast``.

Layers, low to high: the building blocks (store, weights, trainer, rollout, algorithms, data, models, rewards) <
the role loops (modes) < the role entry (roles) < launchers, CLI, benchmarks. The monitor's sinks are used by
the role loops; the role table (roles/spec.py) is plain data every layer above the building blocks may read.
``lifecycle``, ``rundir``, ``fsio``, ``events``, ``errors``, ``config`` are shared by all.
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
