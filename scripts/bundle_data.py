"""Rebuild the small benchmark subset shipped inside the package (calm_core/bundled/data), with license files.

It lets the main job and `calm eval` run on a fresh machine without ../shared/data. Rerun after changing the size:
    python scripts/bundle_data.py --source ../shared/data --per-set 100
"""

from __future__ import annotations

import argparse
import random
import shutil
from pathlib import Path

from calm_core.data import DATASET_FILES, MC_DATASETS, default_split
from calm_core.paths import BUNDLED_DATA_DIR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data")
    parser.add_argument("--per-set", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if BUNDLED_DATA_DIR.exists():
        shutil.rmtree(BUNDLED_DATA_DIR)
    for name in MC_DATASETS:
        rel = DATASET_FILES[name][default_split(name)]
        # Not str.splitlines(): it also splits on U+2028 and friends, which occur inside MMLU questions.
        with open(args.source / rel, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f if line.strip()]
        keep = sorted(random.Random(args.seed).sample(range(len(lines)), min(args.per_set, len(lines))))
        target = BUNDLED_DATA_DIR / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(lines[i] + "\n" for i in keep), encoding="utf-8")
        for lic in (args.source / rel).parent.glob("LICENSE*"):
            shutil.copy(lic, target.parent / lic.name)
        print(f"{target.relative_to(BUNDLED_DATA_DIR)}: {len(keep)} of {len(lines)} rows")
    (BUNDLED_DATA_DIR / "README.md").write_text(
        "Small subset of public QA benchmarks shipped with CALM Gateway so it runs on a fresh machine.\n"
        f"Made by `python scripts/bundle_data.py --per-set {args.per_set} --seed {args.seed}` from the full JSONL\n"
        "(same schema, rows unchanged). Each folder keeps its dataset's license file or license note.\n"
    )


if __name__ == "__main__":
    main()
