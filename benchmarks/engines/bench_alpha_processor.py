"""What the α-head logits processor costs per decode step: its `apply` on a batch of logits at the embedded model's
vocabulary, on one core, for batches on the engine's own head, on one named head (a gateway names its version in
every request), and mixed (own, named and raw rows).

    python benchmarks/engines/bench_alpha_processor.py [--out benchmarks/results]

Built with vLLM's own batch-update types, as vLLM drives it; microseconds per call, median of 5 repeats of 500 calls.
To compare with another commit, run this script from a worktree of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

VOCAB = 49152  # SmolLM2's
BATCHES = (1, 8, 32)


def processor(folder: Path):
    from vllm.v1.sample.logits_processor import BatchUpdate  # noqa: F401  (vLLM's types, imported before ours)

    from adapters.vllm_plugins.alpha import AlphaHeadLogitsProcessor
    from calm_core.alpha_head import AlphaHead
    from calm_core.artifact import BaseModelRef, TokenizerRef, save_artifact

    rng = np.random.default_rng(0)
    for name in ("own", "named"):
        save_artifact(folder / name, AlphaHead(np.exp(rng.normal(size=VOCAB) * 0.1), rng.normal(size=VOCAB)),
                      base_model=BaseModelRef(id="bench", weights_sha256="w"),
                      tokenizer=TokenizerRef(sha256="t", vocab_size=VOCAB), method="bench")
    os.environ["CALM_ARTIFACT"], os.environ["CALM_REGISTRY_DIR"] = str(folder / "own"), str(folder)
    return AlphaHeadLogitsProcessor(None, torch.device("cpu"), False)


def rows(kind: str, batch: int) -> list:
    from vllm import SamplingParams

    named, own, raw = (SamplingParams(extra_args={"calm_head": "named"}), SamplingParams(),
                       SamplingParams(extra_args={"calm_alpha": False}))
    if kind == "mixed":
        return [(own, named, raw)[i % 3] for i in range(batch)]
    return [named if kind == "named" else own] * batch


def per_call_us(proc, kind: str, batch: int) -> float:
    from vllm.v1.sample.logits_processor import BatchUpdate

    params = rows(kind, batch)
    proc.rows.clear()
    proc.update_state(BatchUpdate(batch_size=batch, removed=[], moved=[],
                                  added=[(i, p, None, []) for i, p in enumerate(params)]))
    logits = torch.randn(batch, VOCAB)
    for _ in range(50):
        proc.apply(logits.clone())
    repeats = []
    for _ in range(5):
        copies = [logits.clone() for _ in range(500)]  # apply may work in place: a fresh tensor per call
        start = time.perf_counter()
        for x in copies:
            proc.apply(x)
        repeats.append((time.perf_counter() - start) / len(copies) * 1e6)
    return statistics.median(repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    with tempfile.TemporaryDirectory() as tmp:
        proc = processor(Path(tmp))
        results = {kind: {str(b): round(per_call_us(proc, kind, b), 1) for b in BATCHES}
                   for kind in ("own", "named", "mixed")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "alpha_processor.json").write_text(json.dumps(results, indent=2))
    lines = [f"`python benchmarks/engines/bench_alpha_processor.py` (one core, vocabulary {VOCAB}, µs per `apply`, median "
             "of 5 x 500 calls):", "", "| batch rows on | " + " | ".join(f"batch {b}" for b in BATCHES) + " |",
             "|---|" + "---:|" * len(BATCHES)]
    labels = {"own": "the engine's own head", "named": "one named head (a gateway's batch)",
              "mixed": "own, named and raw rows in turn"}
    for kind, by_batch in results.items():
        lines.append(f"| {labels[kind]} | " + " | ".join(f"{by_batch[str(b)]:.1f}" for b in BATCHES) + " |")
    (args.out / "alpha_processor.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
