"""Cost of one CALM step against one SFT step on the same batches, side by side in one run.

    python benchmarks/loop/bench_step.py --out benchmarks/results

Each measurement runs in its own process (so peak memory is its own): the default training configuration
(configs/train/calm.toml: batch, LoRA layers) on the small smoke split, a few warm-up steps, then the median step
time and the peak resident memory (VmHWM, reset just before the steps) while stepping, both total and above the
resident memory before them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


def worker(method: str, inner_steps: int, steps: int, warmup: int) -> dict:
    import torch

    from training.config import load_config
    from training.methods import STEPS
    from training.trainer import Trainer

    torch.set_num_threads(2)
    cfg = load_config(ROOT / "configs/train/calm.toml", method=method, inner_steps=inner_steps,
                      split=str(ROOT / "configs/splits/smoke.toml"), out_dir="/tmp/calm-bench-step",
                      steps=10_000, eval_every=10_000, checkpoint_every=10_000)
    trainer = Trainer(cfg, show_progress=False).setup()
    def step():
        return STEPS[method](trainer)

    for _ in range(warmup):
        step()
    rss_before = _vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM: the peak below is the steps' own, not set-up's
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {"method": method, "inner_steps": inner_steps, "median_s": statistics.median(times),
            "rss_before": rss_before, "peak_rss": _vm("VmHWM")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "T"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.steps, args.warmup)))
        return
    # Encode the split once before measuring, so no row's peak memory includes a cache miss's encoding pass.
    subprocess.run([sys.executable, __file__, "--worker", "sft", "1", "--steps", "1", "--warmup", "0"],
                   capture_output=True, check=True)
    runs = []
    for method, t in (("sft", 1), ("calm", 1), ("calm", 3), ("calm", 5)):
        proc = subprocess.run([sys.executable, __file__, "--worker", method, str(t), "--steps", str(args.steps),
                               "--warmup", str(args.warmup)], capture_output=True, text=True, check=True)
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(runs[-1], flush=True)
    sft = runs[0]
    lines = ["One optimiser step on the same batches (configs/train/calm.toml: cloze option scoring, batch 8, LoRA on the top 4 layers), "
             f"median of {args.steps} steps after {args.warmup} warm-up, 2 threads.", "",
             "| method | T | step s | time ratio vs SFT | peak RSS while stepping GiB | peak-memory ratio | peak above pre-step RSS MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        own = (r["peak_rss"] - r["rss_before"]) / 2**20
        lines.append(f"| {r['method']} | {r['inner_steps'] if r['method'] == 'calm' else '-'} | {r['median_s']:.3f} | "
                     f"{r['median_s'] / sft['median_s']:.2f} | {r['peak_rss'] / 2**30:.2f} | "
                     f"{r['peak_rss'] / sft['peak_rss']:.3f} | {own:.0f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step.json").write_text(json.dumps(runs, indent=2))
    (args.out / "step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
