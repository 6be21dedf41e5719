"""What CPython's cyclic collector costs while a `calm` process imports its modules, at CPython's young-generation
threshold (700) and at calm_core/collector.py's (20,000), side by side.

Each round and threshold: a fresh interpreter sets the threshold, times every collection (gc_timer's sitecustomize)
and imports what a gateway imports before it serves (the gateway app, the in-process vLLM client, vLLM's async engine,
transformers' tokenizer classes; the CLI last, as it sets the threshold itself); it reports its CPU seconds, those
spent in collections, and the full (oldest generation) collections run.

    python benchmarks/engines/bench_collector.py [--rounds 5] -> benchmarks/results/collector.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
THRESHOLDS = (700, 20_000)
TIMER = REPO / "benchmarks" / "engines" / "gc_timer"  # its sitecustomize times every collection of the child
CHILD = """
import gc, sys
gc.set_threshold(int(sys.argv[1]), *gc.get_threshold()[1:])
import gateway.app, adapters.clients.inprocess, vllm.v1.engine.async_llm
from transformers import AutoConfig, AutoTokenizer
import calm_cli.main  # last: it sets calm_core/collector.py's threshold
"""


def one(threshold: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-c", CHILD, str(threshold)], check=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(TIMER), "GC_TIMER_OUT": out})
        (timed,) = [json.loads(p.read_text()) for p in Path(out).glob("*.json")]  # the child's, alone
    return {"threshold": threshold, "cpu_s": timed["cpu_s"], "collector_s": sum(timed["collector_s"]),
            "full_collections": timed["collections"][2]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "collector")
    args = parser.parse_args()
    runs = []
    for round_ in range(args.rounds):
        for threshold in THRESHOLDS:  # interleaved: the machine's drift falls on both
            runs.append(one(threshold))
            print(f"round {round_ + 1}: {runs[-1]}", flush=True)
    median = {t: {k: statistics.median(r[k] for r in runs if r["threshold"] == t)
                  for k in ("cpu_s", "collector_s", "full_collections")} for t in THRESHOLDS}
    summary = {"rounds": args.rounds, "median": median, "runs": runs}
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    lines = ["# The collector while a gateway's modules import (`python benchmarks/engines/bench_collector.py`)", "",
             f"{args.rounds} interleaved rounds, medians; a fresh interpreter each.", "",
             "| young-generation threshold | CPU to import (s) | in the collector (s) | full collections |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {t:,} | {m['cpu_s']:.2f} | {m['collector_s']:.2f} | {m['full_collections']:.0f} |"
              for t, m in median.items()]
    a, b = (median[t]["cpu_s"] for t in THRESHOLDS)
    lines += ["", f"CPU {THRESHOLDS[1]:,} / {THRESHOLDS[0]}: {b / a:.2f}."]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
