"""Do the calibration answers a free-form retraining job takes from its active mode's judging (vLLM, the parent's
weights as served) equal the ones the trainer generated before (transformers' greedy `generate` on the base model,
training/generative.py's `greedy_targets`)? Run on a job folder the free-form loop test leaves behind:

    pytest tests/test_retrain_loop_free_form.py --basetemp=/tmp/ff
    python benchmarks/loop/served_calibration_answers.py /tmp/ff/loop-free-form0/jobs/*/free_form

Prints how many of the calibration prompts get the same target tokens both ways (the first that differ shown), and
the CPU and wall seconds `generate` took in this process (what the job no longer spends; run it with the suite's
OMP_NUM_THREADS=1 to compare with the worker there).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", type=Path, help="a job's free_form folder (calibration.jsonl, calibration-answers.json)")
    args = parser.parse_args()
    from calm_core.data import load_open_file
    from calm_core.models import resolve_model
    from training.generative import greedy_answer, greedy_targets
    from training.scoring import load_causal_lm, load_tokenizer

    questions = load_open_file(args.stage / "calibration.jsonl")
    served = json.loads((args.stage / "calibration-answers.json").read_text())
    model_path = resolve_model(None).path
    tokenizer = load_tokenizer(model_path)
    model = load_causal_lm(model_path, "float32")
    wall, cpu = time.monotonic(), time.process_time()
    with tempfile.TemporaryDirectory() as cache:  # generated afresh, not read from an earlier run's cache
        generated = greedy_targets(model, tokenizer, questions, Path(cache), "fresh")
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    eos = int(tokenizer.eos_token_id)
    differ = [q for q in questions if greedy_answer(served[q.id], eos) != generated[q.id]]
    print(f"{len(questions) - len(differ)} of {len(questions)} calibration prompts: the same target tokens served "
          f"(vLLM, the active mode) and generated (transformers, the base model); generate took {cpu:.1f} CPU s, "
          f"{wall:.1f} s")
    for q in differ[:5]:
        print(f"  {q.question!r}: served {tokenizer.decode(greedy_answer(served[q.id], eos))!r}, "
              f"generated {tokenizer.decode(generated[q.id])!r}")


if __name__ == "__main__":
    main()
