"""Where a test writes the numbers it measured. `CALM_RECORD_RESULTS=1 pytest -s tests/...` is the command that updates
the documented numbers: it writes into benchmarks/results/, and `python scripts/readme_numbers.py` copies them into the
pages (tests/test_readme_numbers.py checks the copy). Any other run writes into $CALM_HOME/results/, so a CI run
leaves the committed measurements alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def results_dir() -> Path:
    if os.environ.get("CALM_RECORD_RESULTS") == "1":
        return RESULTS
    path = Path(os.environ.get("CALM_HOME", REPO / ".calm")) / "results"
    path.mkdir(parents=True, exist_ok=True)
    return path


def record_runs(name: str, run: dict, keep: int) -> list[dict]:
    """Append one run's measurements to `<name>.json` (the newest `keep` runs are kept) and return the kept runs."""
    path = results_dir() / f"{name}.json"
    runs = json.loads(path.read_text()) if path.is_file() else []
    runs = [*runs, run][-keep:]
    path.write_text(json.dumps(runs, indent=1) + "\n")
    return runs


def record_keyed(name: str, entries: dict[str, dict]) -> dict[str, dict]:
    """Set some entries of `<name>.json` (one per setting or quantity, the newest measurement of each), keeping the
    others; returns them all."""
    path = results_dir() / f"{name}.json"
    kept = json.loads(path.read_text()) if path.is_file() else {}
    kept.update(entries)
    path.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
    return kept


def write_markdown(name: str, text: str) -> Path:
    path = results_dir() / f"{name}.md"
    path.write_text(text.strip() + "\n")
    return path
