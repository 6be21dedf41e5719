"""The processes benchmarks/engines/gc_timer/sitecustomize.py recorded, most CPU first: CPU seconds, seconds in the
collector (young, middle, full) and full collections run.

    python benchmarks/engines/gc_timer/summary.py FOLDER [--top 10]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args()
    runs = sorted((json.loads(p.read_text()) for p in args.folder.glob("*.json")), key=lambda r: -r["cpu_s"])
    for r in runs[:args.top]:
        spent = "/".join(f"{s:.2f}" for s in r["collector_s"])
        print(f"{r['cpu_s']:7.1f} CPU s  collector {sum(r['collector_s']):5.2f} s ({spent})  "
              f"full {r['collections'][2]:3d}  {r['argv'][:90]}")
    print(f"{len(runs)} processes: {sum(r['cpu_s'] for r in runs):.1f} CPU s, "
          f"{sum(sum(r['collector_s']) for r in runs):.1f} s in the collector")


if __name__ == "__main__":
    main()
