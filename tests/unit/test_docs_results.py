"""docs/results holds baselines, not a lab notebook: every file is referenced from the docs and says its machine,
date and command inside; every results link in the docs resolves; docs/benchmarks.md stays a page (<= 300 lines)."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "results"
LINK = re.compile(r"results/([A-Za-z0-9_.-]+\.(?:json|txt))")


def referenced() -> dict[str, list[str]]:
    refs: dict[str, list[str]] = {}
    for doc in sorted((REPO / "docs").glob("*.md")):
        for name in LINK.findall(doc.read_text()):
            refs.setdefault(name, []).append(doc.name)
    return refs


def test_every_result_is_referenced_and_every_reference_exists() -> None:
    refs = referenced()
    files = sorted(p.name for p in RESULTS.iterdir())
    assert [f for f in files if f not in refs] == []
    assert [r for r in refs if not (RESULTS / r).is_file()] == []


def test_every_result_names_its_machine_date_and_command() -> None:
    for f in sorted(RESULTS.iterdir()):
        if f.suffix == ".json":
            rec = json.loads(f.read_text())["recorded"]
            assert re.fullmatch(r"2\d{3}-\d\d-\d\d", rec["date"]) and rec["machine"], f.name
            assert rec["command"].startswith(("relax-hpc ", "bash tools/gpu/suite.sh ")), f.name
        else:
            header = f.read_text().splitlines()[0]
            assert header.startswith("# ") and re.search(r"2\d{3}-\d\d-\d\d", header), f.name
        machine = r"h200|h100|h200host2cpu|dev1cpu|dev2cpu|h200-1gpu|dev2cpu-16runs"
        assert re.search(rf"-({machine})\.(json|txt)$", f.name), f.name


def test_the_benchmarks_page_is_a_page() -> None:
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert len(text.splitlines()) <= 300
    assert not re.search(r"(?i)\b(pass|session)\b \d|\bpass\)|eleventh|tenth pass", text)
