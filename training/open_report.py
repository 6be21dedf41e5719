"""`calm report --task open-ended`: free-form answers, PopQA -> TriviaQA and TriviaQA -> PopQA, every method that
applies to free form, several seeds.

Each direction is a split (configs/splits/open-popqa.toml, open-trivia.toml): train on gold short answers and
calibrate on unlabelled prompts of one dataset, test on held-out questions of it (in-domain) and of the other
(out-of-domain); the split's leakage check holds for both. Trained methods run through the same Trainer as multiple
choice (answer format "generative"); every row is evaluated the same way, as served: vLLM on the merged weights with
the row's α head (training/free_form_eval.py), greedy answers for accuracy and token confidence, and out of domain
`samples` sampled answers for semantic confidence (sampling is most of the evaluation's cost; the targets are out of
domain, so in-domain rows report token confidence only).

Post-hoc rows reuse the SFT model: sft+temperature fits T on the gold answers of the (labelled) calibration questions;
sft+daca fits T label-free where the model before fine-tuning and the SFT model predict the same next token, at the
positions of the initial model's greedy answers to the calibration prompts. The uncalibrated model is evaluated once:
both directions test on the same questions, in swapped roles.

The report resumes: rerun with the same configuration and it keeps the rows `report.json` already holds (the 3-seed
report takes hours on 2 cores). Each row's training, fitting and evaluation time is kept with it, so `total_seconds`
is the report's cost on the machine that ran it, across resumed runs.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
import torch  # noqa: E402

from calm_core.alpha_head import AlphaHead  # noqa: E402
from calm_core.artifact import save_artifact  # noqa: E402
from calm_core.engine import EngineFactory  # noqa: E402
from calm_core.plots import reliability_diagram  # noqa: E402
from training.artifacts import model_refs  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.free_form_eval import FreeFormRecord, evaluate_served, evaluate_sets, free_form_metrics  # noqa: E402
from training.generative import GenerativeFormat, gold_target, position_logits  # noqa: E402
from training.posthoc import fit_daca_temperature, fit_token_temperature  # noqa: E402
from training.trainer import Trainer  # noqa: E402

DIRECTIONS = {"popqa->triviaqa": "configs/splits/open-popqa.toml", "triviaqa->popqa": "configs/splits/open-trivia.toml"}
TRAINED = ("sft", "label_smoothing", "regularization", "iterate", "calm_scalar", "calm")
ROWS = ("uncalibrated", "sft", "sft+temperature", "sft+daca", "label_smoothing", "regularization", "iterate",
        "calm_scalar", "calm")
METRICS = ("accuracy", "mean_confidence", "ece_10", "sem_accuracy", "sem_mean_confidence", "sem_ece_10", "brier",
           "auroc", "aurc")
ROLES = (("test_in_domain", "in_domain"), ("test_out_of_domain", "out_of_domain"))
POSTHOC_QUESTIONS = 300  # calibration questions temperature scaling is fitted on (gold answers: a few tokens each)
DACA_QUESTIONS = 64  # DACA's: each brings up to 32 greedy-answer positions of full-vocabulary logits (~0.2 MB each)


def _test_questions(trainer: Trainer, limit: int | None = None) -> dict[str, list]:
    return {name: [q for qs in trainer.split.sources[role].values() for q in qs][:limit] for role, name in ROLES}


def _evaluate(engines: EngineFactory, weights, artifact_dir, tests: dict[str, list], samples: int) -> tuple[dict, dict]:
    """Metrics per role, and the records (for plots). Sampled answers (semantic confidence) out of domain only: the
    targets are there, and sampling is most of an evaluation's cost (in-domain rows report token confidence)."""
    per_role = evaluate_sets(engines, weights, artifact_dir, tests, samples, sampled={"out_of_domain"})
    return {name: free_form_metrics(recs) for name, recs in per_role.items()}, per_role


def _uncalibrated(engines: EngineFactory, trainer: Trainer, tests: dict[str, list], samples: int,
                  out: Path) -> tuple[dict, dict]:
    """The model before fine-tuning, no head; its records are kept in `out` and reused by the other direction (both
    directions test on the same questions, in swapped roles)."""
    cache = out / f"uncalibrated-records-{samples}.json"
    known = {r["id"]: FreeFormRecord(**r) for r in json.loads(cache.read_text())} if cache.is_file() else {}
    missing = [q for qs in tests.values() for q in qs if q.id not in known]
    if missing:
        with tempfile.TemporaryDirectory() as tmp:
            identity = _head_artifact(Path(tmp, "identity"), trainer, AlphaHead.identity(trainer.vocab_size), "identity")
            known.update({r.id: r for r in evaluate_served(engines, trainer.resolved.path, identity, missing, samples)})
        cache.write_text(json.dumps([asdict(r) for r in known.values()]))
    per_role = {name: [known[q.id] for q in qs] for name, qs in tests.items()}
    return {name: free_form_metrics(recs) for name, recs in per_role.items()}, per_role


def _head_artifact(path: Path, trainer: Trainer, head: AlphaHead, method: str) -> Path:
    base, tok = model_refs(trainer.resolved, trainer.tokenizer, trainer.vocab_size)
    save_artifact(path, head, base_model=base, tokenizer=tok, method=method, answer_format="generative",
                  applies_to="free_form")
    return path


@torch.no_grad()
def posthoc_temperatures(trainer: Trainer) -> dict[str, float]:
    """sft+temperature (gold answers of labelled calibration questions) and sft+daca (label-free agreement)."""
    calib = trainer.calib_set
    questions = calib.questions[:POSTHOC_QUESTIONS]
    gold = GenerativeFormat(trainer.tokenizer, {q.id: gold_target(trainer.tokenizer, q) for q in questions})
    items = gold.encode(trainer.model, trainer.tokenizer, questions, trainer.first_trained, 16)
    z, _ = position_logits(trainer.model, items, trainer.first_trained, trainer.device)
    targets = torch.cat([q.targets for q in items])
    temperature = fit_token_temperature(z, targets)
    # DACA at the initial model's greedy-answer positions (the calibration items the upper level uses).
    z_sft, _ = position_logits(trainer.model, calib.items[:DACA_QUESTIONS], trainer.first_trained, trainer.device)
    with trainer.model.disable_adapter():
        z_ref, _ = position_logits(trainer.model, calib.items[:DACA_QUESTIONS], trainer.first_trained, trainer.device)
    daca = fit_daca_temperature(z_ref, z_sft)
    return {"sft+temperature": temperature, "sft+daca": daca}


def run_direction(engines: EngineFactory, base: TrainConfig, direction: str, seeds: list[int], out: Path, samples: int,
                  steps: int | None, results: dict, pooled: dict, limit: int | None = None) -> None:
    split = DIRECTIONS[direction]
    for seed in seeds:
        for method in TRAINED:
            if seed in results[direction][method]:
                continue  # measured by an earlier, interrupted run of this report
            run_dir = out / "runs" / direction.replace("->", "-") / f"{method}-s{seed}"
            cfg = TrainConfig.model_validate({**base.model_dump(), "method": method, "seed": seed, "split": split,
                                              "answer_format": "generative", "out_dir": str(run_dir),
                                              **({"steps": steps} if steps else {})})
            started = time.monotonic()
            trainer = Trainer(cfg).setup()
            tests = _test_questions(trainer, limit)
            if "uncalibrated" not in results[direction]["_done"]:
                clock = time.monotonic()
                metrics, recs = _uncalibrated(engines, trainer, tests, samples, out)
                for s in seeds:  # one measurement, shown for every seed; its time counted once
                    results[direction]["uncalibrated"][s] = {**metrics, "seconds": {"evaluate": 0.0}}
                results[direction]["uncalibrated"][seeds[0]]["seconds"]["evaluate"] = time.monotonic() - clock
                pooled[direction]["uncalibrated"] = recs["out_of_domain"]
                results[direction]["_done"].append("uncalibrated")
                started += time.monotonic() - clock
            trainer.resume(restart_if_mismatched=True)
            trainer.train()
            artifact = trainer.export()
            clock = time.monotonic()
            temps = posthoc_temperatures(trainer) if method == "sft" else {}
            fitting = (time.monotonic() - clock) / max(len(temps), 1)
            train_seconds = clock - started
            with tempfile.TemporaryDirectory() as tmp:
                clock = time.monotonic()
                metrics, recs = _evaluate(engines, trainer.resolved.path, artifact, tests, samples)  # adapter merged
                merged = trainer.write_merged(Path(tmp, "merged")) if temps else None
                metrics["seconds"] = {"train": train_seconds, "evaluate": time.monotonic() - clock}
                results[direction][method][seed] = metrics
                if seed == seeds[0]:
                    pooled[direction][method] = recs["out_of_domain"]
                for row, t in temps.items():
                    clock = time.monotonic()
                    head_dir = _head_artifact(Path(tmp, row.replace("+", "-")), trainer, AlphaHead.scalar(t), row)
                    metrics, recs = _evaluate(engines, merged, head_dir, tests, samples)  # SFT's weights
                    metrics["in_domain"]["fitted_temperature"] = t
                    metrics["seconds"] = {"fit": fitting, "evaluate": time.monotonic() - clock}
                    results[direction][row][seed] = metrics
                    if seed == seeds[0]:
                        pooled[direction][row] = recs["out_of_domain"]
            shutil.rmtree(run_dir / "merged", ignore_errors=True)
            _write(out, base, seeds, steps, samples, limit, results, pooled)


def run_open_report(engines: EngineFactory, base: TrainConfig, seeds: list[int], out: Path, steps: int | None = None, samples: int = 8,
                    directions: list[str] | None = None, limit: int | None = None) -> dict:
    """Every row of both directions (or those named); `limit`: test questions per role (the splits hold 200)."""
    out.mkdir(parents=True, exist_ok=True)
    results = {d: {row: {} for row in ROWS} | {"_done": []} for d in DIRECTIONS}
    pooled: dict[str, dict[str, list[FreeFormRecord]]] = {d: {} for d in DIRECTIONS}
    _resume(out, base, steps, samples, limit, results, pooled)
    for direction in directions or list(DIRECTIONS):
        run_direction(engines, base, direction, seeds, out, samples, steps, results, pooled, limit)
    return json.loads((out / "report.json").read_text())


def _resume(out: Path, base: TrainConfig, steps: int | None, samples: int, limit: int | None, results: dict,
            pooled: dict) -> None:
    """Continue an interrupted report: the rows already measured with the same configuration are kept (long reports
    span sessions on a 2-core machine); the first seed's out-of-domain records come back for the plots."""
    path = out / "report.json"
    if not path.is_file():
        return
    previous = json.loads(path.read_text())
    if ((previous["config"], previous["steps"], previous["samples"], previous.get("questions_per_role"))
            != (base.model_dump(), steps or base.steps, samples, limit)):
        return  # another configuration: start over
    for direction, rows in previous["per_seed"].items():
        for row, by_seed in rows.items():
            results[direction][row] = {int(s): m for s, m in by_seed.items()}
        if rows.get("uncalibrated"):
            results[direction]["_done"].append("uncalibrated")
    records = out / "records.json"
    if records.is_file():
        for direction, rows in json.loads(records.read_text()).items():
            pooled[direction] = {row: [FreeFormRecord(**r) for r in recs] for row, recs in rows.items()}


def _aggregate(by_seed: dict[int, dict]) -> dict:
    table = {}
    for _, name in ROLES:
        table[name] = {}
        for m in METRICS:
            values = [by_seed[s][name][m] for s in by_seed if m in by_seed[s][name]]
            if values:
                table[name][m] = {"mean": float(np.mean(values)), "std": float(np.std(values))}
    return table


def _write(out: Path, base: TrainConfig, seeds: list[int], steps: int | None, samples: int, limit: int | None,
           results: dict, pooled: dict) -> None:
    seconds = {d: {row: sum(sum(m.get("seconds", {}).values()) for m in r.values())
                   for row, r in rows.items() if row != "_done" and r} for d, rows in results.items()}
    summary = {"config": base.model_dump(), "seeds": seeds, "steps": steps or base.steps, "samples": samples,
               "questions_per_role": limit,
               # Time spent on each row's training, fitting and evaluation, summed over seeds and over resumed runs:
               # the report's cost on this machine, whichever sessions it ran in.
               "seconds": seconds, "total_seconds": sum(sum(r.values()) for r in seconds.values()),
               "table": {d: {row: _aggregate(r) for row, r in rows.items() if row != "_done" and r}
                         for d, rows in results.items()},
               "per_seed": {d: {row: r for row, r in rows.items() if row != "_done"} for d, rows in results.items()}}
    (out / "report.json").write_text(json.dumps(summary, indent=2))
    (out / "report.md").write_text(markdown(summary))
    (out / "records.json").write_text(json.dumps(
        {d: {row: [asdict(r) for r in recs] for row, recs in rows.items()} for d, rows in pooled.items()}))
    for direction, rows in pooled.items():
        if rows:
            curves = {row: (np.array([r.token_confidence for r in recs]), np.array([r.correct for r in recs], dtype=float))
                      for row, recs in rows.items()}
            name = direction.replace("->", "-")
            reliability_diagram(curves, out / f"reliability-{name}.png",
                                title=f"{direction}: out-of-domain reliability, token confidence (first seed)")


def markdown(summary: dict) -> str:
    cfg = summary["config"]
    lines = [f"# Open-ended CALM report: {len(summary['seeds'])} seed(s) {summary['seeds']}, {summary['steps']} steps, "
             f"batch {cfg['batch_size']}, LoRA r={cfg['lora_rank']} on the top {cfg['lora_top_layers']} layers, "
             f"semantic confidence from {summary['samples']} samples", "",
             "Token confidence: exp(mean calibrated log-prob) of the greedy answer; Sem-: the semantic answer and its "
             "cluster's share. ECE with 10 bins; Brier, AUROC and AURC of the token confidence. Mean ± std over seeds; "
             f"{summary.get('questions_per_role') or 200} test questions per role; n/a: AUROC of a set with no right answer; "
             "–: not measured (semantic confidence is sampled out of domain only).", "",
             f"Compute: {summary.get('total_seconds', 0) / 60:.0f} min of training, fitting and evaluation in all "
             "(summed over rows, seeds and resumed runs).", ""]
    cell = lambda v: "n/a" if v["mean"] != v["mean"] else f"{v['mean']:.3f} ± {v['std']:.3f}"  # noqa: E731  (NaN: AUROC of an all-wrong set)
    for direction, rows in summary["table"].items():
        if not rows:
            continue
        for _, name in ROLES:
            lines += [f"## {direction}: {name.replace('_', '-')}", "",
                      "| method | " + " | ".join(METRICS) + " |", "|---|" + "---|" * len(METRICS)]
            for row in ROWS:
                if row not in rows or name not in rows[row]:
                    continue
                cells = [cell(rows[row][name][m]) if m in rows[row][name] else "–" for m in METRICS]
                lines.append(f"| {row} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)
