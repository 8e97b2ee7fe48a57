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
