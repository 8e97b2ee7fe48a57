"""Where the test suite's time goes, from a ``RELAX_TEST_TIMES=FILE`` run of the suite (tests/conftest.py).

  RELAX_TEST_TIMES=/tmp/times.jsonl bash tools/test.sh ...
  python tools/test_times.py /tmp/times.jsonl [--top 25]

Prints the slowest tests, and wall and CPU seconds summed by module and by xdist group (a module, or the tier for
the slurm and netfs tiers, each on one worker): the largest group bounds the suite's wall time from below,
the CPU sum over the cores bounds it too.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COSTS = ROOT / "tests" / "group_costs.json"


def group(test: str) -> str:
    """The test's xdist group, as tests/conftest.py names it: its tier for the serial tiers, else tier/module."""
    parts = test.split("::")[0].removesuffix(".py").split("/")
    tier, module = parts[-2], parts[-1]
    return tier if tier in ("slurm", "netfs") else f"{tier}/{module}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--write", action="store_true",
                    help=f"store each group's wall seconds in {COSTS.relative_to(ROOT)} (tests/conftest.py hands the "
                         "costliest groups to the workers first)")
    a = ap.parse_args()
    rows = [json.loads(x) for x in a.file.read_text().splitlines() if x.strip()]
    wall, cpu, gwall, gcpu = Counter(), Counter(), Counter(), Counter()
    for r in rows:
        mod = r["test"].split("::")[0]
        wall[mod] += r["wall_s"]
        cpu[mod] += r["cpu_s"]
        gwall[group(r["test"])] += r["wall_s"]
        gcpu[group(r["test"])] += r["cpu_s"]
    print(f"{len(rows)} tests: wall {sum(wall.values()):.0f} s summed, CPU {sum(cpu.values()):.0f} s")
    for r in rows:
        if r.get("outcome", "passed") != "passed":
            print(f"  {r['outcome']}: {r['test']}")
    print(f"\nslowest {a.top} tests (wall s, CPU s)")
    for r in sorted(rows, key=lambda r: -r["wall_s"])[:a.top]:
        print(f"{r['wall_s']:8.1f} {r['cpu_s']:8.1f}  {r['test']}")
    print(f"\nlargest {a.top} groups (wall s, CPU s)")
    for g, w in gwall.most_common(a.top):
        print(f"{w:8.0f} {gcpu[g]:8.0f}  {g}")
    if a.write:
        COSTS.write_text(json.dumps({g: round(c, 1) for g, c in sorted(gwall.items())}, indent=1) + "\n")
        print(f"wrote {COSTS}")


if __name__ == "__main__":
    main()
