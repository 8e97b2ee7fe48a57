"""The demo's figures, from the run dirs of ``bash tools/demo.sh`` (colocate) and ``bash tools/demo.sh --set
mode=fully_async``: the numbers of the README's demo table, kept in ``tests/unit/golden/demo_figures.json``.

  python tools/demo_figures.py --colocate RUN_DIR --fully-async RUN_DIR [--wall-colocate S --wall-fully-async S]
                               [--no-warmup RUN_DIR] [--write]

Prints the table rows; ``--write`` stores the figures (and the colocate run's first rewards, which
``tests/integration/test_readme_commands.py`` compares with a short run of the code as it is) in the golden file and
rewrites the
README's table from them (between its ``demo-table`` markers). The colocate
reward series is deterministic on the CPU (same seed, same series); fully_async depends on timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "unit" / "golden" / "demo_figures.json"
README = ROOT / "README.md"
BEGIN, END = "<!-- demo-table: tools/demo_figures.py -->", "<!-- /demo-table -->"
FIRST = 10
"""The colocate run's first RL rewards stored in full (a short run must reproduce them exactly)."""


def rewards(run_dir: Path) -> dict[int, float]:
    """Step -> mean reward of that step, from the trainer's event log."""
    logs = run_dir / "logs" / "events"
    path = next(p for p in (logs / "trainer-0.jsonl", logs / "colocate-0.jsonl") if p.is_file())
    out: dict[int, float] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        m = rec.get("metrics") or {}
        if rec.get("kind") == "metrics" and isinstance(rec.get("step"), int) and "rollout/reward" in m:
            out[rec["step"]] = float(m["rollout/reward"])
    return out


def mean(r: dict[int, float], first: int, last: int) -> float:
    return statistics.fmean(r[s] for s in range(first, last + 1))


def figures(run_dir: Path) -> dict[str, object]:
    r = rewards(run_dir)
    n = max(r)
    out: dict[str, object] = {"steps": n, "first_step": r[1], "last_step": r[n], "first_10": mean(r, 1, min(n, 10))}
    if n >= 50:
        out["last_50"] = mean(r, n - 49, n)
    if n >= 300:
        out["steps_251_300"] = mean(r, 251, 300)
    return out


def table(fig: dict[str, dict[str, object]]) -> list[str]:
    def f(x: object) -> str:
        return f"{float(x):.2f}"  # type: ignore[arg-type]

    c, a = fig["colocate"], fig["fully_async"]
    rows = ["| stage | mean reward |", "| --- | --- |"]
    if "no_warmup" in fig:
        rows.append(f"| random initialisation, no warm-up (first 10 RL steps) | {f(fig['no_warmup']['first_10'])} |")
    rows += [f"| after the 30-step warm-up (first 10 RL steps, colocate) | {f(c['first_10'])} |",
             f"| after RL, colocate (last 50 of {c['steps']} steps) | {f(c['last_50'])} "
             f"({f(c['steps_251_300'])} over steps 251-300; last step {f(c['last_step'])}) |",
             f"| after RL, `--set mode=fully_async` (last 50 of {a['steps']} steps) | {f(a['last_50'])} "
             f"({f(a['steps_251_300'])} over steps 251-300; last step {f(a['last_step'])}) |"]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--colocate", type=Path, required=True)
    p.add_argument("--fully-async", type=Path, required=True)
    p.add_argument("--no-warmup", type=Path, default=None, help="a run with --set warmup.steps=0 (10+ steps)")
    p.add_argument("--wall-colocate", type=float, default=None, help="wall seconds of the colocate demo")
    p.add_argument("--wall-fully-async", type=float, default=None, help="wall seconds of the fully_async demo")
    p.add_argument("--write", action="store_true", help=f"store the figures in {GOLDEN.relative_to(ROOT)}")
    a = p.parse_args(argv)
    fig: dict[str, dict[str, object]] = {"colocate": figures(a.colocate), "fully_async": figures(a.fully_async)}
    r = rewards(a.colocate)
    fig["colocate"]["first_rewards"] = [r[s] for s in range(1, FIRST + 1)]
    if a.no_warmup is not None:
        fig["no_warmup"] = figures(a.no_warmup)
        fig["no_warmup"]["first_rewards"] = [v for _, v in sorted(rewards(a.no_warmup).items())][:FIRST]
    for key, wall in (("colocate", a.wall_colocate), ("fully_async", a.wall_fully_async)):
        if wall is not None:
            fig[key]["wall_s"] = wall
    print("\n".join(table(fig)))
    if a.write:
        GOLDEN.write_text(json.dumps(fig, indent=1) + "\n")
        README.write_text(with_table(README.read_text(), table(fig)))
        print(f"wrote {GOLDEN} and the table in {README}", file=sys.stderr)
    return 0


def with_table(text: str, rows: list[str]) -> str:
    """``text`` (the README) with the rows between its demo-table markers replaced."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"error: {README} has no {BEGIN} ... {END} markers")
    return head + BEGIN + "\n" + "\n".join(rows) + "\n" + END + tail


def readme_table(text: str) -> list[str]:
    """The rows between the README's demo-table markers."""
    return text.partition(BEGIN)[2].partition(END)[0].strip().splitlines()


if __name__ == "__main__":
    sys.exit(main())
