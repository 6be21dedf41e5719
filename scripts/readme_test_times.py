"""Copy the measured test-suite times into the README between its markers: the fresh-clone runs
(benchmarks/results/test-runs.md), the time per file before and after issue 22 (test-times-before.md, test-times.md)
and the slow-machine runs (slow-machine.md). Run after scripts/fresh_clone_test.sh or scripts/slow_machine_test.sh."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def per_file(path: Path) -> tuple[float, dict[str, float]]:
    text = path.read_text()
    total = float(re.search(r"Test time: ([\d.]+) min", text).group(1))
    rows = re.findall(r"^\| (tests/\S+\.py) \| \d+ \| ([\d.]+) \|", text, re.M)
    return total, {name: float(seconds) for name, seconds in rows}


def times_table(top: int = 12) -> str:
    before_total, before = per_file(RESULTS / "test-times-before.md")
    after_total, after = per_file(RESULTS / "test-times.md")
    lines = ["| file | before (s) | after (s) |", "|---|---:|---:|"]
    for name in sorted(before, key=lambda n: -before[n])[:top]:
        lines.append(f"| {name} | {before[name]:.0f} | {after.get(name, 0.0):.0f} |")
    lines.append(f"| **all {len(before)} files** | **{before_total * 60:.0f}** | **{after_total * 60:.0f}** |")
    return "\n".join(lines)


def fill(readme: str, marker: str, body: str) -> str:
    start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
    return re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: f"{start}\n{body}\n{end}", readme, flags=re.S)


def main() -> None:
    readme = (REPO / "README.md").read_text()
    readme = fill(readme, "test-runs", (RESULTS / "test-runs.md").read_text().strip())
    readme = fill(readme, "test-times", times_table())
    slow = RESULTS / "slow-machine.md"
    if slow.is_file():
        readme = fill(readme, "slow-machine", slow.read_text().strip())
    (REPO / "README.md").write_text(readme)


if __name__ == "__main__":
    main()
