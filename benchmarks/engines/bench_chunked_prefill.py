"""What prefilling each prompt in one step costs a CPU engine against vLLM's chunked prefill, side by side in one run.

    python benchmarks/engines/bench_chunked_prefill.py --out benchmarks/results [--rounds 3]

The CPU engines run without chunked prefill (adapters/hosting/engine_settings.py, CPU_CHUNKED_PREFILL: a seeded request
prefilled in chunks kills a CPU engine). Two vLLM engines of the embedded model with the CPU settings the gateway
uses, one with vLLM's chunked prefill and one without, get the same work, all submitted at once (the most prompt per
step a gateway can hand them), rounds interleaved:
  free form     96 TriviaQA questions in the chat template, greedy, 16 tokens;
  long prompts  the 64 MMLU questions with the longest cloze prompts (250+ tokens), each option appended (256
                prompts), one token each: prefill only, what option scoring asks of an engine.
Unseeded requests (seeded ones are what chunked prefill cannot run on CPU). Wall time per workload, tokens per second
(prompt and generated), and whether both engines gave the same text. Results: chunked_prefill.json / .md in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from adapters.hosting.engine_settings import EngineOverrides, resolve  # noqa: E402
from benchmarks.scoring.bench_long_mc import long_questions  # noqa: E402
from calm_core.data import load_open  # noqa: E402
from calm_core.models import resolve_model  # noqa: E402
from calm_core.prompts import cloze_prompt  # noqa: E402
from training.generative import free_form_prompt  # noqa: E402

WAYS = {"chunked (vLLM's default)": True, "whole prompts (CPU engines now)": False}


def workloads(tokenizer) -> dict[str, tuple[list[str], int]]:
    """name -> (prompts, max_tokens)."""
    chat = [free_form_prompt(tokenizer, q.question) for q in load_open("triviaqa")[:96]]  # as the gateway renders it
    questions, _ = long_questions(64)
    options = [cloze_prompt(q.question) + " " + choice for q in questions for choice in q.choices]
    return {"free form": (chat, 16), "long prompts": (options, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    settings = resolve(EngineOverrides(), detected="cpu")
    os.environ.update(settings.env())
    from vllm import LLM, SamplingParams

    model = resolve_model(None, "float32").path
    engines = {way: LLM(model=str(model), max_model_len=2048, seed=0,
                        **{**settings.vllm_kwargs(), "enable_chunked_prefill": chunked})
               for way, chunked in WAYS.items()}
    work = workloads(next(iter(engines.values())).get_tokenizer())
    seconds: dict = {w: {way: [] for way in WAYS} for w in work}
    texts: dict = {w: {} for w in work}
    tokens: dict = {}
    for r in range(args.rounds):
        order = list(WAYS) if r % 2 == 0 else list(reversed(WAYS))
        for name, (prompts, max_tokens) in work.items():
            for way in order:
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
                start = time.perf_counter()
                outs = engines[way].generate(prompts, params, use_tqdm=False)
                seconds[name][way].append(time.perf_counter() - start)
                texts[name][way] = [o.outputs[0].text for o in outs]
                tokens[name] = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
                print(f"round {r + 1}, {name}, {way}: {seconds[name][way][-1]:.1f} s", file=sys.stderr, flush=True)
    results = {"rounds": args.rounds, "engine": settings.as_dict(), "workloads": {}}
    for name in work:
        best = {way: min(s) for way, s in seconds[name].items()}
        a, b = best.values()
        results["workloads"][name] = {
            "prompts": len(work[name][0]), "tokens": tokens[name], "seconds": seconds[name],
            "tokens_per_s": {way: tokens[name] / s for way, s in best.items()}, "whole_over_chunked": a / b,
            "same_text": len({tuple(t) for t in texts[name].values()}) == 1}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chunked_prefill.json").write_text(json.dumps(results, indent=2))
    lines = [f"Chunked prefill on a CPU engine (the embedded model, float32, {os.cpu_count()} CPUs), every request of a "
             f"workload submitted at once, best of {args.rounds} interleaved rounds:", "",
             "| workload | prompts | tokens | " + " | ".join(f"{w}: tokens/s" for w in WAYS)
             + " | whole / chunked throughput | same text |", "|---|---|---|---|---|---|---|"]
    for name, r in results["workloads"].items():
        rates = " | ".join(f"{r['tokens_per_s'][w]:.0f}" for w in WAYS)
        lines.append(f"| {name} | {r['prompts']} | {r['tokens']} | {rates} | {r['whole_over_chunked']:.3f} | "
                     f"{'yes' if r['same_text'] else 'no'} |")
    (args.out / "chunked_prefill.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
