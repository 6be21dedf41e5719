"""Free-form answers evaluated as the gateway serves them, through the gateway's scorers (calm_core/scorers/) on an
engine the caller injects (`calm_core.engine.EngineFactory`; the CLI passes vLLM in process, adapters/clients/inprocess.py):
the artifact's weights (adapter merged) with its α head in the logits processor, the question as the one user message
under the chat template.

Per question: the greedy answer (at most MAX_TOKENS tokens) and its token confidence (the token scorer: the geometric
mean of the calibrated token probabilities, end-of-turn token included; and the total sequence probability),
correctness by alias match (calm_core.answers.is_correct); and, where asked, the semantic scorer's answer (the same
greedy answer: recorded, so that a report can show it is) and its confidence from `samples` answers sampled without the
head in one request, mapped by the mode's semantic calibration (calm_core/semantic.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import tempfile
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from calm_core.answers import ANSWER_TOKENS, is_correct
from calm_core.artifact import load_artifact, update_manifest
from calm_core.data import OpenQuestion, serving_domain
from calm_core.engine import EngineClient, EngineFactory, EngineRequest
from calm_core.errors import ConfigError
from calm_core.metrics import aurc, auroc, binned_calibration_error
from calm_core.models import resolve_model
from calm_core.plots import reliability_diagram
from calm_core.prompts import PreparedPrompt
from calm_core.scorers.base import PostHoc, ScoringJob
from calm_core.scorers.free_form import SemanticScorer, TokenScorer
from calm_core.semantic import SemanticCalibration
from training.artifacts import reference_histogram, write_identity_artifact
from training.evaluate import sample_questions
from training.generative import free_form_prompt
from training.scoring import load_tokenizer

MAX_TOKENS = ANSWER_TOKENS


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
    semantic_agreeing: int | None = None  # how many of the samples say what the answer says
    cluster_sizes: list[int] | None = None
    # The greedy answer's token ids as the engine gave them (its end-of-turn token included when it stopped): a
    # retraining job's free-form stage trains on the active mode's answers as served (training/retrain/free_form.py).
    token_ids: list[int] | None = None


class StageProgress:
    """A line on stderr at every tenth of a stage: an offline evaluation with samples runs for tens of minutes, mostly
    under nohup, where a terminal progress bar would print nothing until the end."""

    def __init__(self, stage: str, total: int):
        self.stage, self.total, self.done, self.start = stage, total, 0, time.monotonic()

    def step(self) -> None:
        self.done += 1
        if self.done == self.total or self.done % max(1, self.total // 10) == 0:
            print(f"{self.stage}: {self.done}/{self.total} questions ({time.monotonic() - self.start:.0f} s)",
                  file=sys.stderr, flush=True)


async def answer_questions(engine: EngineClient, tokenizer, questions: list[OpenQuestion], samples: int,
                           max_tokens: int = MAX_TOKENS, greedy_only: Collection[str] = (),
                           semantic_calibration: SemanticCalibration | None = None,
                           token_temperature: float = 1.0, head_keeps_order: bool = False) -> list[FreeFormRecord]:
    """Greedy answers first (all questions at once: the engine batches them), then the sampled ones."""
    post_hoc = PostHoc(semantic=semantic_calibration, token_temperature=token_temperature,
                       head_keeps_order=head_keeps_order)
    token, semantic = TokenScorer(engine, tokenizer, post_hoc), SemanticScorer(engine, tokenizer, post_hoc)

    def job(i: int, q: OpenQuestion, **changes) -> ScoringJob:
        prompt = PreparedPrompt(free_form_prompt(tokenizer, q.question), None)
        request = EngineRequest(request_id=f"ff{i}", prompt=prompt.text, max_tokens=max_tokens)
        return ScoringJob(prompt, replace(request, **changes), with_raw=True, samples=samples)

    async def greedy(i: int, q: OpenQuestion) -> FreeFormRecord:
        c = (await token.score(replace(job(i, q), with_raw=False))).choices[0]
        greedy_done.step()
        lps = c.calibrated_logprobs
        return FreeFormRecord(q.id, serving_domain(q), c.text, is_correct(c.text, q.answers, q.question),
                              c.confidence, float(math.exp(sum(lps))), len(lps),
                              token_ids=list(c.output.token_ids) if c.output is not None else None)

    async def sampled(i: int, q: OpenQuestion, record: FreeFormRecord) -> None:
        # Seeded by the scorer as the gateway's are (samples_seed: from the prompt), so a rerun draws the same samples.
        c = (await semantic.score(job(i, q, request_id=f"sem{i}"))).choices[0]
        record.semantic_text, record.semantic_confidence = c.text, c.confidence
        record.semantic_agreeing = round(c.raw_confidence * samples)
        record.semantic_correct = is_correct(c.text, q.answers, q.question)
        record.cluster_sizes = [size for _, size in c.clusters]
        sampled_done.step()

    greedy_done = StageProgress("greedy answers", len(questions))
    records = await asyncio.gather(*(greedy(i, q) for i, q in enumerate(questions)))
    if samples:
        to_sample = [(i, q, r) for i, (q, r) in enumerate(zip(questions, records)) if q.id not in greedy_only]
        sampled_done = StageProgress(f"{samples} sampled answers each", len(to_sample))
        await asyncio.gather(*(sampled(i, q, r) for i, q, r in to_sample))
    return list(records)


def evaluate_served(engines: EngineFactory, base_model: str | Path, artifact_dir: str | Path,
                    questions: list[OpenQuestion], samples: int = 8, max_tokens: int = MAX_TOKENS,
                    greedy_only: Collection[str] = ()) -> list[FreeFormRecord]:
    """Records for the questions on an engine serving the artifact (its adapter merged into `base_model`) with its α
    head; the questions whose ids are in `greedy_only` get no sampled answers (no semantic confidence)."""
    tokenizer = load_tokenizer(str(base_model))
    artifact = load_artifact(artifact_dir)
    manifest = artifact.manifest

    async def run() -> list[FreeFormRecord]:
        async with engines(str(base_model), str(artifact_dir)) as engine:
            return await answer_questions(engine, tokenizer, questions, samples, max_tokens, greedy_only,
                                          manifest.semantic, manifest.token_temperature, artifact.head.keeps_order)

    return asyncio.run(run())


def evaluate_sets(engines: EngineFactory, base_model: str | Path, artifact_dir: str | Path,
                  sets: dict[str, list[OpenQuestion]], samples: int = 8,
                  sampled: Collection[str] | None = None) -> dict[str, list[FreeFormRecord]]:
    """Records per named set, every distinct question answered once, on one engine; `sampled`: the sets whose
    questions also get `samples` sampled answers (default every set)."""
    unique = {q.id: q for qs in sets.values() for q in qs}
    with_samples = {q.id for name, qs in sets.items() if sampled is None or name in sampled for q in qs}
    records = {r.id: r for r in evaluate_served(engines, base_model, artifact_dir, list(unique.values()), samples,
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
        same = np.mean([r.semantic_text == r.text for r in records])
        out.update(sem_same_answer=float(same), sem_accuracy=float(scorrect.mean()),
                   sem_mean_confidence=float(sconf.mean()),
                   sem_ece_10=binned_calibration_error(sconf, scorrect, n_bins),
                   sem_brier=float(np.mean((sconf - scorrect) ** 2)), sem_auroc=auroc(sconf, scorrect))
    return out


HELD_OUT = "\0held-out"  # the reference-histogram questions among measure_artifact's sets (no test label clashes)


def measure_artifact(engines: EngineFactory, artifact_dir: str | Path, base_model_path: str,
                     tests: dict[str, list[OpenQuestion]], held_out: list[OpenQuestion],
                     samples: int = 0) -> dict[str, dict[str, float]]:
    """A free-form artifact's metrics per test set and its reference histograms per serving domain (token confidence
    of greedy answers to held-out questions), written into its manifest; returns the metrics."""
    artifact = load_artifact(artifact_dir)
    per_set = evaluate_sets(engines, base_model_path, artifact_dir, {**tests, HELD_OUT: held_out}, samples)
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


def run_free_form_eval(engines: EngineFactory, specs, artifact: str | None, model: str | None, limit: int | None,
                       seed: int, samples: int, out: Path) -> dict:
    """`calm eval` on open-ended sets: the artifact's free-form mode (or the model without a head) as served."""
    resolved = resolve_model(model)
    sets = {spec.label: sample_questions(spec.load(), limit, seed) for spec in specs}
    with tempfile.TemporaryDirectory() as tmp:
        if artifact:
            mode = load_artifact(artifact).free_form
            if mode is None:
                raise ConfigError(f"artifact {artifact} has no free-form mode (it is fitted to multiple choice only)")
            head_dir, version = mode.path, mode.manifest.artifact_version
        else:
            head_dir, version = Path(tmp, "identity"), None
            write_identity_artifact(head_dir, model, with_reference=False)
        per_set = evaluate_sets(engines, resolved.path, head_dir, sets, samples)
    summary = {"model": resolved.id, "artifact": version, "answer_format": "generative", "samples": samples,
               "limit": limit, "seed": seed}
    return write_free_form_report(out, per_set, summary)


def write_free_form_report(out: Path, per_set: dict[str, list[FreeFormRecord]], summary: dict) -> dict:
    """report.json, report.md, reliability.png and answers_<set>.jsonl of free-form records (offline or through a
    gateway: the same report); `summary` names the model, artifact and settings."""
    out.mkdir(parents=True, exist_ok=True)
    model, version, samples = summary["model"], summary["artifact"], summary["samples"]
    results, panels = {}, {}
    for label, recs in per_set.items():
        results[label] = free_form_metrics(recs)
        panels[label] = (np.array([r.token_confidence for r in recs]), np.array([r.correct for r in recs], dtype=float))
        (out / f"answers_{label.replace(':', '_').replace('@', '_')}.jsonl").write_text(  # no token ids: text is read
            "".join(json.dumps({k: v for k, v in asdict(r).items() if k != "token_ids"}) + "\n" for r in recs))
    summary = {**summary, "results": results}
    reliability_diagram(panels, out / "reliability.png", title=model + (f" + {version}" if version else ""))
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    cols = ("n", "accuracy", "mean_confidence", "ece_10", "brier", "auroc", "aurc", "sem_same_answer",
            "sem_mean_confidence", "sem_ece_10", "sem_auroc", "mean_tokens")
    lines = [f"# Free-form evaluation: {model}" + (f" + free-form mode `{version}`" if version else " (no α head)")
             + (f", {summary['scored_by']}" if summary.get("scored_by") else ""),
             "", f"Greedy answers as served (token confidence); semantic confidence of the same answers from {samples} "
             "answers sampled without the head (sem_same_answer: the share of semantic answers equal to the greedy "
             "one).", "",
             "| dataset | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for label, m in results.items():
        lines.append(f"| {label} | " + " | ".join(f"{m[c]:.3f}" if c in m else "–" for c in cols) + " |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
    return summary
