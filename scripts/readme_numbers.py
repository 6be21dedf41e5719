"""The documentation's measured numbers (README.md and docs/*.md), each copied from the file the command that measured
it wrote. Every block between `<!-- NAME:start -->` and `<!-- NAME:end -->` in those pages is listed in BLOCKS with its
source and that command; `python scripts/readme_numbers.py` rewrites every block from its source, and
tests/test_readme_numbers.py fails when a block differs from its source, is not listed, or stands on two pages.

    CALM_RECORD_RESULTS=1 pytest -s tests/test_retrain_loop.py -k drift_alert   # measure (writes benchmarks/results)
    python scripts/readme_numbers.py                                           # copy into the pages
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "README.md"


def pages() -> list[Path]:
    """The pages that may hold measured blocks: the README and the documents it links."""
    return [README, *sorted((REPO / "docs").glob("*.md"))]


def page_of(name: str) -> Path:
    """The page holding block `name` (the first, should a block stand twice: the test refuses that)."""
    return next(p for p in pages() if name in block_names(p.read_text()))


@dataclass(frozen=True)
class Block:
    name: str
    command: str  # what measures the numbers and writes `source`
    source: Path
    render: Callable[[Path], str] = lambda path: path.read_text().strip()


def per_file(path: Path) -> tuple[float, dict[str, float]]:
    text = path.read_text()
    total = float(re.search(r"Test time: ([\d.]+) min", text).group(1))
    rows = re.findall(r"^\| (tests/\S+\.py) \| \d+ \| ([\d.]+) \|", text, re.M)
    return total, {name: float(seconds) for name, seconds in rows}


def times_table(after: Path, top: int = 12) -> str:
    """Seconds per test file before issue 22 (test-times-before.md) and in the newest fresh-clone run."""
    before_total, before = per_file(RESULTS / "test-times-before.md")
    after_total, after_rows = per_file(after)
    lines = ["| file | before (s) | after (s) |", "|---|---:|---:|"]
    for name in sorted(before, key=lambda n: -before[n])[:top]:
        lines.append(f"| {name} | {before[name]:.0f} | {after_rows.get(name, 0.0):.0f} |")
    lines.append(f"| **all {len(before)} files** | **{before_total * 60:.0f}** | **{after_total * 60:.0f}** |")
    return "\n".join(lines)


def report_body(path: Path) -> str:
    """A `calm report` markdown file under a section of a page: its title line dropped, its sections two levels down."""
    lines = path.read_text().strip().splitlines()[1:]
    return "\n".join("##" + line if line.startswith("## ") else line for line in lines).strip()


BLOCKS = [
    Block("test-runs", "bash scripts/fresh_clone_test.sh 1", RESULTS / "test-runs.md"),
    Block("test-times", "bash scripts/fresh_clone_test.sh 1", RESULTS / "test-times.md", times_table),
    Block("slow-machine", "bash scripts/slow_machine_test.sh", RESULTS / "slow-machine.md"),
    Block("conformance", "CALM_RECORD_RESULTS=1 pytest tests/test_openai_conformance.py", RESULTS / "conformance.md"),
    Block("fuzz", "CALM_RECORD_RESULTS=1 CALM_FUZZ_EXAMPLES=150 pytest tests/test_fuzz.py (then without the "
          "examples variable)", RESULTS / "fuzz.md"),
    Block("bf16", "CALM_RECORD_RESULTS=1 pytest tests/test_bf16_budget.py", RESULTS / "bf16_budget.md"),
    Block("lean", "python benchmarks/gateway/bench_lean.py --out benchmarks/results --profile", RESULTS / "lean.md"),
    Block("retrain-loop", "CALM_RECORD_RESULTS=1 pytest tests/test_retrain_loop.py -k drift_alert",
          RESULTS / "retrain_loop.md"),
    Block("retrain-loop-free-form", "CALM_RECORD_RESULTS=1 pytest -s tests/test_retrain_loop_free_form.py",
          RESULTS / "retrain_loop_free_form.md"),
    Block("free-form-subsets", "python benchmarks/scoring/free_form_subsets.py --by-relation", RESULTS / "free_form_subsets.md"),
    Block("label-free-loop", "python benchmarks/loop/bench_label_free_loop.py", RESULTS / "label_free_loop.md"),
    Block("recalibration", "python benchmarks/loop/bench_recalibration.py", RESULTS / "recalibration.md"),
    Block("cloze-formats", "python benchmarks/scoring/cloze_formats.py", RESULTS / "cloze_formats.md"),
    Block("calm-report", "calm report --out reports/calm", REPO / "reports" / "calm" / "report.md", report_body),
    Block("open-ended-report", "calm report --task open-ended --out reports/open-ended",
          REPO / "reports" / "open-ended" / "report.md", report_body),
    Block("fleet", "python benchmarks/gateway/bench_fleet.py", RESULTS / "fleet.md"),
    Block("gateway", "python benchmarks/gateway/bench_gateway.py", RESULTS / "gateway.md"),
    Block("escalation-latency", "python benchmarks/gateway/bench_escalation.py", RESULTS / "escalation.md"),
    Block("long-mc", "python benchmarks/scoring/bench_long_mc.py", RESULTS / "long_mc.md"),
    Block("block-size", "python benchmarks/engines/bench_block_size.py", RESULTS / "block_size.md"),
    Block("stock-engine", "python benchmarks/engines/bench_stock_engine.py", RESULTS / "stock_engine.md"),
    Block("engine-allocator", "python benchmarks/engines/bench_engine_server.py --compare allocator", RESULTS / "engine_allocator.md"),
    Block("engine-block-size", "python benchmarks/engines/bench_engine_server.py --compare block-size",
          RESULTS / "engine_block_size.md"),
    Block("engine-threads", "python benchmarks/engines/bench_engine_threads.py", RESULTS / "engine_threads.md"),
    Block("hot-swap", "python benchmarks/engines/bench_hot_swap.py", RESULTS / "hot_swap.md"),
    Block("free-form-batching", "python benchmarks/scoring/bench_free_form_batching.py", RESULTS / "free_form_batching.md"),
    Block("added-latency", "python benchmarks/gateway/bench_added_latency.py --rounds 3 --questions 24", RESULTS / "added_latency.md"),
    Block("dashboard", "python benchmarks/load/dashboard_run.py", RESULTS / "dashboard.md"),
    Block("responses-api", "python benchmarks/gateway/bench_responses_api.py", RESULTS / "responses_api.md"),
]


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def block_names(readme: str) -> list[str]:
    return re.findall(r"<!-- ([\w-]+):start -->", readme)


def read_block(readme: str, name: str) -> str:
    start, end = markers(name)
    return readme.split(start + "\n", 1)[1].split("\n" + end, 1)[0]


def fill(readme: str, block: Block) -> str:
    start, end = markers(block.name)
    body = block.render(block.source)
    return re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: f"{start}\n{body}\n{end}", readme, flags=re.S)


def main() -> None:
    for page in pages():
        text = page.read_text()
        for block in BLOCKS:
            if block.name in block_names(text) and block.source.is_file():
                text = fill(text, block)
        page.write_text(text)


if __name__ == "__main__":
    main()
