"""Free-form answers evaluated as the gateway serves them: vLLM on the artifact's weights (adapter merged) with its α
head in the logits processor, the question as the one user message under the chat template.

Per question: the greedy answer (at most MAX_TOKENS tokens), its token confidence (calm_core.scoring.
sequence_confidence: the geometric mean of the calibrated token probabilities, end-of-turn token included; and the
total sequence probability), correctness by alias match (calm_core.answers.is_correct); and `samples` answers sampled
at temperature 1 in one request (vLLM's n), at most SAMPLE_TOKENS tokens each, clustered by meaning
(calm_core.answers.semantic_choice): the semantic answer, its correctness, and its confidence, the cluster's share.

vLLM runs in a child process (`python -m training.free_form_eval`): an engine per evaluated artifact, and none of its
memory left in the process that trains.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from calm_core.answers import is_correct, semantic_choice
from calm_core.data import OpenQuestion, serving_domain
from calm_core.metrics import aurc, auroc, binned_calibration_error
from calm_core.scoring import sequence_confidence

MAX_TOKENS = 48  # the base model's answers are sentences; the entity comes early or not at all
SAMPLE_TOKENS = 32  # sampled answers for semantic confidence: clusters form on the answer's start; rambling costs


@dataclass
class FreeFormRecord:
    id: str
    domain: str
    text: str
    correct: bool
    token_confidence: float  # length-normalised: exp(mean calibrated token log-prob)
    sequence_probability: float  # total: exp(sum)
    n_tokens: int
    semantic_text: str | None = None
    semantic_correct: bool | None = None
    semantic_confidence: float | None = None
    cluster_sizes: list[int] | None = None


def _question_row(q: OpenQuestion, samples: int) -> dict:
    return {"id": q.id, "question": q.question, "answers": list(q.answers), "domain": serving_domain(q),
            "samples": samples}


def generate_records(model_dir: str, artifact_dir: str, rows: list[dict], samples: int, max_tokens: int,
                     seed: int = 0) -> list[FreeFormRecord]:
    """The child process's work: one vLLM engine, greedy answers, then `samples` answers per question."""
    from vllm import LLM, SamplingParams

    from adapters.vllm_common import EngineConfig
    from training.generative import free_form_messages

    config = EngineConfig(model_path=model_dir, artifact_path=artifact_dir, seed=seed, max_model_len=1024)
    llm = LLM(**config.engine_kwargs())  # the α head of `artifact_dir` in the logits processor
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(free_form_messages(r["question"]), tokenize=False, add_generation_prompt=True)
               for r in rows]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0), use_tqdm=True)
    records = []
    for row, out in zip(rows, greedy):
        c = out.outputs[0]
        lps = [float(p[t].logprob) for t, p in zip(c.token_ids, c.logprobs)]
        records.append(FreeFormRecord(row["id"], row["domain"], c.text, is_correct(c.text, row["answers"], row["question"]),
                                      sequence_confidence(lps), float(math.exp(sum(lps))), len(lps)))
    wanted = [i for i, row in enumerate(rows) if row.get("samples", samples)]
    if wanted:
        # No per-request seed: vLLM's CPU sampler cannot seed requests whose prefill is chunked; the engine seed holds.
        params = [SamplingParams(n=rows[i].get("samples", samples), max_tokens=min(max_tokens, SAMPLE_TOKENS),
                                 temperature=1.0, logprobs=0) for i in wanted]
        sampled = llm.generate([prompts[i] for i in wanted], params, use_tqdm=True)
        for row, rec, out in zip([rows[i] for i in wanted], [records[i] for i in wanted], sampled):
            texts = [c.text for c in out.outputs]
            probs = [sequence_confidence([float(p[t].logprob) for t, p in zip(c.token_ids, c.logprobs)])
                     for c in out.outputs]
            choice = semantic_choice(texts, probs)
            rec.semantic_text = texts[choice.answer]
            rec.semantic_correct = is_correct(rec.semantic_text, row["answers"], row["question"])
            rec.semantic_confidence = choice.confidence
            rec.cluster_sizes = [c.size for c in choice.clusters]
    return records


def evaluate_served(model_dir: str | Path, artifact_dir: str | Path, questions: list[OpenQuestion], samples: int = 8,
                    max_tokens: int = MAX_TOKENS, greedy_only: Collection[str] = ()) -> list[FreeFormRecord]:
    """Records for the questions, computed in a child process (vLLM on CPU or GPU, as the gateway runs it); the
    questions whose ids are in `greedy_only` get no sampled answers (no semantic confidence)."""
    with tempfile.TemporaryDirectory() as tmp:
        qpath, rpath = Path(tmp, "questions.jsonl"), Path(tmp, "records.jsonl")
        qpath.write_text("".join(json.dumps(_question_row(q, 0 if q.id in greedy_only else samples)) + "\n"
                                 for q in questions))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, "-m", "training.free_form_eval", "--model", str(model_dir), "--artifact",
               str(artifact_dir), "--questions", str(qpath), "--out", str(rpath), "--samples", str(samples),
               "--max-tokens", str(max_tokens)]
        done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"free-form evaluation failed:\n{done.stderr[-4000:]}")
        return [FreeFormRecord(**json.loads(line)) for line in rpath.read_text().splitlines()]


def evaluate_sets(model_dir: str | Path, artifact_dir: str | Path, sets: dict[str, list[OpenQuestion]],
                  samples: int = 8, sampled: Collection[str] | None = None) -> dict[str, list[FreeFormRecord]]:
    """Records per named set, every distinct question answered once, all in one child process; `sampled`: the sets
    whose questions also get `samples` sampled answers (default every set)."""
    unique = {q.id: q for qs in sets.values() for q in qs}
    with_samples = {q.id for name, qs in sets.items() if sampled is None or name in sampled for q in qs}
    records = {r.id: r for r in evaluate_served(model_dir, artifact_dir, list(unique.values()), samples,
                                                greedy_only=unique.keys() - with_samples)}
    return {label: [records[q.id] for q in qs] for label, qs in sets.items()}


def free_form_metrics(records: list[FreeFormRecord], n_bins: int = 10) -> dict[str, float]:
    """Token-confidence metrics of the greedy answers; Sem-* of the semantic answers when they were sampled."""
    conf = np.array([r.token_confidence for r in records])
    correct = np.array([r.correct for r in records], dtype=float)
    out = {"n": float(len(records)), "accuracy": float(correct.mean()), "mean_confidence": float(conf.mean()),
           "ece_10": binned_calibration_error(conf, correct, n_bins), "brier": float(np.mean((conf - correct) ** 2)),
           "auroc": auroc(conf, correct), "aurc": aurc(conf, correct),
           "mean_tokens": float(np.mean([r.n_tokens for r in records]))}
    if records and all(r.semantic_confidence is not None for r in records):
        sconf = np.array([r.semantic_confidence for r in records])
        scorrect = np.array([r.semantic_correct for r in records], dtype=float)
        out.update(sem_accuracy=float(scorrect.mean()), sem_mean_confidence=float(sconf.mean()),
                   sem_ece_10=binned_calibration_error(sconf, scorrect, n_bins),
                   sem_brier=float(np.mean((sconf - scorrect) ** 2)), sem_auroc=auroc(sconf, scorrect))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="free-form answers of an artifact through vLLM (child process)")
    p.add_argument("--model", required=True)
    p.add_argument("--artifact", required=True)
    p.add_argument("--questions", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in Path(args.questions).read_text().splitlines()]
    records = generate_records(args.model, args.artifact, rows, args.samples, args.max_tokens)
    Path(args.out).write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))


if __name__ == "__main__":
    main()


HELD_OUT = "\0held-out"  # the reference-histogram questions among measure_artifact's sets (no test label clashes)


def measure_artifact(artifact_dir: str | Path, base_model_path: str, tests: dict[str, list[OpenQuestion]],
                     held_out: list[OpenQuestion], samples: int = 0) -> dict[str, dict[str, float]]:
    """A free-form artifact's metrics per test set and its reference histograms per serving domain (token confidence
    of greedy answers to held-out questions), written into its manifest; returns the metrics."""
    from calm_core.artifact import load_artifact, update_manifest
    from adapters.merged_weights import merged_model_dir
    from training.artifacts import reference_histogram

    artifact = load_artifact(artifact_dir)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = merged_model_dir(base_model_path, artifact, Path(tmp))
        per_set = evaluate_sets(model_dir, artifact_dir, {**tests, HELD_OUT: held_out}, samples)
    held = per_set.pop(HELD_OUT)
    metrics = {label: free_form_metrics(recs) for label, recs in per_set.items()}
    by_domain: dict[str, list[float]] = {"all": []}
    for q, record in zip(held_out, held):
        conf = record.token_confidence
        by_domain.setdefault(serving_domain(q), []).append(conf)
        by_domain["all"].append(conf)
    histograms = {d: reference_histogram(np.array(c)) for d, c in by_domain.items()}
    # Undefined metrics (AUROC of a set with no right answer) are left out: the manifest holds numbers.
    stored = {label: {k: v for k, v in m.items() if math.isfinite(v)} for label, m in metrics.items()}
    update_manifest(artifact_dir, metrics={**artifact.manifest.metrics, **stored}, reference_histograms=histograms)
    return metrics


def run_free_form_eval(specs, artifact: str | None, model: str | None, limit: int | None, seed: int, samples: int,
                       out: Path) -> dict:
    """`calm eval` on open-ended sets: the artifact's free-form mode (or the model without a head) as served."""
    from calm_core.artifact import load_artifact
    from calm_core.errors import ConfigError
    from calm_core.models import resolve_model
    from calm_core.plots import reliability_diagram
    from adapters.merged_weights import merged_model_dir
    from training.evaluate import sample_questions

    resolved = resolve_model(model)
    sets = {spec.label: sample_questions(spec.load(), limit, seed) for spec in specs}
    with tempfile.TemporaryDirectory() as tmp:
        if artifact:
            mode = load_artifact(artifact).free_form
            if mode is None:
                raise ConfigError(f"artifact {artifact} has no free-form mode (it is fitted to multiple choice only)")
            model_dir, head_dir, version = merged_model_dir(resolved.path, mode, Path(tmp)), mode.path, mode.manifest.artifact_version
        else:
            from training.artifacts import write_identity_artifact

            head_dir = Path(tmp, "identity")
            write_identity_artifact(head_dir, model, with_reference=False)
            model_dir, version = resolved.path, None
        per_set = evaluate_sets(model_dir, head_dir, sets, samples)
    out.mkdir(parents=True, exist_ok=True)
    results, panels = {}, {}
    for label, recs in per_set.items():
        results[label] = free_form_metrics(recs)
        panels[label] = (np.array([r.token_confidence for r in recs]), np.array([r.correct for r in recs], dtype=float))
        (out / f"answers_{label.replace(':', '_').replace('@', '_')}.jsonl").write_text(
            "".join(json.dumps(asdict(r)) + "\n" for r in recs))
    summary = {"model": resolved.id, "artifact": version, "answer_format": "generative", "samples": samples,
               "limit": limit, "seed": seed, "results": results}
    reliability_diagram(panels, out / "reliability.png", title=resolved.id + (f" + {version}" if version else ""))
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    cols = ("n", "accuracy", "mean_confidence", "ece_10", "brier", "auroc", "aurc", "sem_accuracy",
            "sem_mean_confidence", "sem_ece_10", "mean_tokens")
    lines = [f"# Free-form evaluation: {resolved.id}" + (f" + free-form mode `{version}`" if version else " (no α head)"),
             "", f"Greedy answers as served (token confidence), {samples} sampled answers for semantic confidence.", "",
             "| dataset | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for label, m in results.items():
        lines.append(f"| {label} | " + " | ".join(f"{m[c]:.3f}" if c in m else "–" for c in cols) + " |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return summary
