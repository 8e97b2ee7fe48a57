"""The test suite's own layout: tests live in tier folders, share code only through tests/helpers (a test module
is never imported by another), and never edit ``sys.path`` (the repository root is on it through the ``tests``
package; scripts run from tests/helpers find their siblings as scripts do)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "slurm", "netfs", "gpu")


def modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_test_module_is_in_a_tier() -> None:
    stray = [p.relative_to(TESTS).as_posix() for p in TESTS.glob("test_*.py")]
    stray += [p.relative_to(TESTS).as_posix() for p in TESTS.glob("*/test_*.py") if p.parent.name not in TIERS]
    assert not stray, f"test modules outside the tiers {TIERS}: {stray}"


def test_no_test_module_imports_another() -> None:
    bad = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(TESTS)}: {n}" for n in names
                    if n.split(".")[-1].startswith("test_") or any(n.startswith(f"tests.{t}") for t in TIERS)]
    assert not bad, "test modules imported by other modules (move the shared code to tests/helpers):\n" + \
        "\n".join(bad)


def test_no_sys_path_edits() -> None:
    bad = [f"{p.relative_to(TESTS)}:{n.lineno}" for p in modules() for n in ast.walk(ast.parse(p.read_text()))
           if isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
           and n.value.id == "sys" and p.name != "test_suite_layout.py"]
    assert not bad, f"sys.path used in {bad}"


def _top_names(init: Path) -> set[str]:
    names: set[str] = set()
    for n in ast.parse(init.read_text()).body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Assign):
            names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return names


def _resolves(module: str, name: str | None) -> bool:
    base = TESTS.parent.joinpath(*module.split("."))
    init = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
    if name is None or name == "*":
        return init.is_file()
    return (base / f"{name}.py").is_file() or (init.is_file() and name in _top_names(init))


def test_every_import_of_the_tests_package_resolves() -> None:
    """An import inside a test function (run only when that test runs) cannot name a module the tiers moved."""
    bad = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests":
                bad += [f"{path.relative_to(TESTS)}:{node.lineno}: from {node.module} import {a.name}"
                        for a in node.names if not _resolves(node.module or "", a.name)]
            elif isinstance(node, ast.Import):
                bad += [f"{path.relative_to(TESTS)}:{node.lineno}: import {a.name}" for a in node.names
                        if a.name.split(".")[0] == "tests" and not _resolves(a.name, None)]
    assert not bad, "imports of modules that do not exist:\n" + "\n".join(bad)
