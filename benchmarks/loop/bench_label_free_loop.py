"""What a label-free retraining job should change (issue 66): the loop run each way on domains the shipped artifact
never trained on, scored on held-out labelled questions of each domain and at home.

Per domain (built from ../shared/data): 200 questions as the captured traffic (unlabelled), 300 others as the
held-out labelled questions. Per way:
- `calm`: CALM on θ and α from the serving version, 100 steps (configs/train/loop-calm.toml, the loop's default until
  2026-12-06), through the real worker on a scratch database and registry;
- `calm_head`: the same job with θ held, only the head moves (configs/train/loop.toml, the default since);
- `atc`: no training: one temperature on the serving version's option scores, chosen without labels
  (calm_core/label_free.py: ATC's predicted accuracy from the home questions, mean confidence matched to it).
Parent and candidate are scored as the gateway serves them (training/artifact_scoring.py) on the domain's held-out
questions and on the home questions (the loop's science test set: ARC-Easy 200 + ARC-Challenge 100), and on the
captured traffic for the label-free checks (how often the chosen option stays the parent's; Spearman correlation of
the confidences).

    python benchmarks/loop/bench_label_free_loop.py [--ways atc,calm_head,calm,references] [--domains medicine,commonsense,stem]

`references` adds the same held-out questions under the uncalibrated model, SFT and SFT + temperature scaling.

Writes benchmarks/results/label_free_loop.{json,md,png}; a rerun adds or replaces (domain, way) rows.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy.optimize import brentq

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from calm_core.artifact import load_artifact  # noqa: E402
from calm_core.capture import Capture, CaptureSettings  # noqa: E402
from calm_core.data import MCQuestion, load_mc  # noqa: E402
from calm_core.db import Database  # noqa: E402
from calm_core.label_free import choice_movement  # noqa: E402
from calm_core.jobs import JobQueue  # noqa: E402
from calm_core.models import resolve_model  # noqa: E402
from calm_core.paths import BUNDLED_DIR  # noqa: E402
from calm_core.recalibration import tempered  # noqa: E402
from calm_core.registry import Registry  # noqa: E402
from training.artifact_scoring import served_probabilities  # noqa: E402
from training.retrain.worker import Worker, metrics_of  # noqa: E402
from training.retrain.data import write_questions  # noqa: E402
from training.retrain.gate import LoopConfig  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
SHIPPED = BUNDLED_DIR / "artifacts" / "smollm2-135m-instruct"
TRAIN_CONFIGS = {"calm": "configs/train/loop-calm.toml", "calm_head": "configs/train/loop.toml"}
N_CAPTURED, N_HELD_OUT = 200, 300


# -- ATC: a label-free temperature, measured here, not shipped (docs/retraining-loop.md says why) -------------------
# Average thresholded confidence (Garg et al. 2022, arXiv 2201.04234): the confidence t above which the share of home
# answers equals the home accuracy; the share of the domain's answers above t predicts the domain's accuracy; the
# domain's temperature makes its mean confidence equal that prediction.
T_BOUNDS = (0.05, 20.0)  # as fit_temperature's


@dataclass(frozen=True)
class LabelFreeFit:
    threshold: float  # ATC's confidence threshold, from the home questions
    home_accuracy: float
    predicted_accuracy: float  # the share of the domain's traffic above the threshold
    mean_confidence_before: float  # on the domain's traffic
    temperature: float  # mean confidence on the traffic under it = predicted_accuracy (within the bounds)


def atc_threshold(confidence: Sequence[float], correct: Sequence[bool]) -> float:
    """The confidence above which the share of home answers equals the home accuracy."""
    conf, right = np.asarray(confidence, dtype=np.float64), np.asarray(correct, dtype=bool)
    if conf.size == 0 or conf.size != right.size:
        raise ValueError("need one verdict per confidence, at least one")
    return float(np.quantile(conf, 1.0 - right.mean()))


def mean_confidence(log_probs: Sequence[np.ndarray], temperature: float) -> float:
    return float(np.mean([p.max() for p in tempered(log_probs, temperature)]))


def temperature_for(log_probs: Sequence[np.ndarray], target: float) -> float:
    """The T whose mean top-option probability over these questions is `target` (mean confidence falls as T rises;
    a target beyond what T_BOUNDS reach gets the nearer bound)."""
    lo, hi = T_BOUNDS
    gap = lambda log_t: mean_confidence(log_probs, float(np.exp(log_t))) - target  # noqa: E731
    if gap(np.log(lo)) <= 0:
        return lo
    if gap(np.log(hi)) >= 0:
        return hi
    return float(np.exp(brentq(gap, np.log(lo), np.log(hi), xtol=1e-6)))


def fit_label_free(home_confidence: Sequence[float], home_correct: Sequence[bool],
                   domain_log_probs: Sequence[np.ndarray]) -> LabelFreeFit:
    """ATC's prediction of the domain's accuracy and the temperature that makes the domain's confidence match it.
    `domain_log_probs`: each captured question's option log-probs (any scores up to a constant) as served now."""
    if not domain_log_probs:
        raise ValueError("need the domain's traffic")
    t = atc_threshold(home_confidence, home_correct)
    conf = np.array([p.max() for p in tempered(domain_log_probs, 1.0)])
    predicted = float((conf > t).mean())
    return LabelFreeFit(t, float(np.mean(home_correct)), predicted, float(conf.mean()),
                        temperature_for(domain_log_probs, predicted))


def domain_questions(domain: str, data: Path) -> list[MCQuestion]:
    """A domain's pool, past the rows the science split tests out of domain (the first 300)."""
    if domain == "medicine":
        return load_mc("medmcqa", "dev", root=data)[300:]
    if domain == "commonsense":
        return load_mc("commonsenseqa", "dev", root=data)[300:]
    if domain == "stem":
        return [q for q in load_mc("mmlu", "test", root=data) if q.category == "STEM"]
    raise SystemExit(f"unknown domain {domain}")


def split_domain(domain: str, data: Path) -> tuple[list[MCQuestion], list[MCQuestion]]:
    pool = domain_questions(domain, data)
    random.Random(0).shuffle(pool)
    return pool[:N_CAPTURED], pool[N_CAPTURED:N_CAPTURED + N_HELD_OUT]


def home_questions(data: Path) -> list[MCQuestion]:
    return load_mc("arc_easy", "test", root=data)[:200] + load_mc("arc_challenge", "test", root=data)[:100]


def parent_probabilities(domain: str, model_path: str, *sets: list[MCQuestion]) -> list[np.ndarray]:
    """The shipped version's option probabilities on the domain's sets, kept between runs (a rerun of one way)."""
    key = f"{domain}-{load_artifact(SHIPPED).manifest.artifact_version}-" + "-".join(str(len(s)) for s in sets)
    path = Path(tempfile.gettempdir()) / "label-free-loop" / f"{key}.npz"
    if path.is_file():
        return list(np.load(path).values())
    probs = served_probabilities([load_artifact(SHIPPED)], model_path, *sets)[0]
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, *probs)
    return probs


def agreement(parent: np.ndarray, candidate: np.ndarray) -> dict:
    """The gate's label-free numbers on the captured prompts (calm_core/label_free.py), under this table's keys."""
    moved = choice_movement(parent, candidate)
    return {"choice_agreement": moved.choice_agreement, "confidence_spearman": moved.confidence_correlation}


def train_with_worker(way: str, domain: str, captured: list[MCQuestion], held_out_file: Path, work: Path) -> tuple[Path, dict]:
    """The real worker on a scratch database: the shipped artifact serves, the captured prompts are the domain's
    traffic, the held-out questions its test set. Returns the candidate's folder and the job's result."""
    work.mkdir(parents=True, exist_ok=True)
    db = Database(f"sqlite:///{work / 'db.sqlite3'}")
    registry = Registry(db, work / "registry")
    registry.ensure_default(SHIPPED)
    capture = Capture(db)
    settings = CaptureSettings(enabled=True)
    capture.configure(domain, settings)
    capture.add(domain, settings, [("multiple_choice", q.question, list(q.choices), None) for q in captured])
    cfg = LoopConfig(train_config=str(REPO / TRAIN_CONFIGS[way]), runs_dir=str(work / "jobs"),
                     test_sets={domain: [{"dataset": domain, "split": "test", "path": str(held_out_file)}]})
    job, _ = JobQueue(db).enqueue(domain, "operator", {})
    Worker(cfg, db, work / "registry").run(once=True)
    done = JobQueue(db).get(job.id)
    if done.candidate is None:
        raise RuntimeError(f"{way} on {domain}: no candidate: {done.log[-3:]}")
    return registry.path_of(done.candidate), done.result


def run_domain(domain: str, ways: list[str], data: Path, model_path: str, out: dict) -> None:
    captured, held_out = split_domain(domain, data)
    home = home_questions(data)
    with tempfile.TemporaryDirectory(prefix=f"label-free-{domain}-") as tmp:
        held_out_file = write_questions(Path(tmp) / "held_out.jsonl", held_out)
        t0 = time.perf_counter()
        p_captured, p_held, p_home = parent_probabilities(domain, model_path, captured, held_out, home)
        parent = {"held_out": metrics_of(p_held, held_out), "home": metrics_of(p_home, home)}
        print(f"[{domain}] parent scored in {time.perf_counter() - t0:.0f} s: held-out {parent['held_out']}", flush=True)
        for way in ways:
            t0 = time.perf_counter()
            if way == "atc":
                home_conf = p_home.max(1)
                home_right = p_home.argmax(1) == np.array([q.answer for q in home])
                log_p = lambda probs, qs: [np.log(np.maximum(p[: len(q.choices)], 1e-300)) for p, q in zip(probs, qs)]  # noqa: E731
                fit = fit_label_free(home_conf, home_right, log_p(p_captured, captured))
                pad = lambda ps, width: np.array([np.pad(p, (0, width - len(p))) for p in ps])  # noqa: E731
                c_captured = pad(tempered(log_p(p_captured, captured), fit.temperature), p_captured.shape[1])
                c_held = pad(tempered(log_p(p_held, held_out), fit.temperature), p_held.shape[1])
                c_home = pad(tempered(log_p(p_home, home), fit.temperature), p_home.shape[1])
                detail = {"fit": fit.__dict__}
            else:
                cand_dir, result = train_with_worker(way, domain, captured, held_out_file, Path(tmp) / way)
                # The job scored both versions on the held-out questions (its test set) by the same rule.
                c_captured, c_home = served_probabilities([load_artifact(cand_dir)], model_path, captured, home)[0]
                detail = {"job_in_domain": result["in_domain"]}
            held = metrics_of(c_held, held_out) if way == "atc" else result["in_domain"]["candidate"]
            row = {"domain": domain, "way": way, "seconds": round(time.perf_counter() - t0, 1),
                   "n_captured": len(captured), "parent": parent,
                   "candidate": {"held_out": held, "home": metrics_of(c_home, home)},
                   "label_free": agreement(p_captured, c_captured), **detail}
            out[f"{domain}/{way}"] = row
            save(out)
            c = row["candidate"]["held_out"]
            print(f"[{domain}/{way}] {row['seconds']:.0f} s: ECE {parent['held_out']['ece_10']:.3f} -> {c['ece_10']:.3f}, "
                  f"AUROC {parent['held_out']['auroc']:.3f} -> {c['auroc']:.3f}, home accuracy "
                  f"{parent['home']['accuracy']:.3f} -> {row['candidate']['home']['accuracy']:.3f}, {row['label_free']}",
                  flush=True)


# -- reference rows: the same held-out questions under the uncalibrated model, SFT and SFT + temperature scaling ---
def sft_artifact(work: Path) -> Path:
    """SFT on the shipped recipe's data and schedule (configs/train/shipped.toml with method sft), trained once."""
    from training.config import load_config
    from training.trainer import Trainer

    path = work / "sft" / "artifact"
    if not (path / "manifest.json").is_file():
        cfg = load_config(REPO / "configs/train/shipped.toml", method="sft", out_dir=str(work / "sft"))
        trainer = Trainer(cfg, show_progress=True).setup()
        trainer.train()
        trainer.export()
    return path


def run_references(domains: list[str], data: Path, model_path: str, out: dict) -> None:
    from calm_core.prompts import AnswerFormat
    from calm_core.splits import load_split, materialize
    from training.artifact_scoring import load_served_model, option_probabilities
    from training.posthoc import fit_temperature
    from training.scoring import load_tokenizer

    work = Path(tempfile.gettempdir()) / "label-free-loop"
    sft = sft_artifact(work)
    held = {d: split_domain(d, data)[1] for d in domains}
    calibration = materialize(load_split(REPO / "configs/splits/science.toml"), data).role("calibration")
    tokenizer = load_tokenizer(model_path)
    base = load_served_model(model_path, None)
    uncalibrated = {d: option_probabilities(base, tokenizer, qs, AnswerFormat.CLOZE, None) for d, qs in held.items()}
    sft_calib, *sft_held = served_probabilities([load_artifact(sft)], model_path, calibration, *held.values())[0]
    # Temperature scaling fitted on the labelled calibration questions of the home split (the post-hoc baseline).
    n_options = np.array([len(q.choices) for q in calibration])
    z = np.where(np.arange(sft_calib.shape[1]) < n_options[:, None], np.log(np.maximum(sft_calib, 1e-300)), -np.inf)
    t = fit_temperature(z, np.array([q.answer for q in calibration]), n_options)
    for (domain, qs), p_sft in zip(held.items(), sft_held):
        log_p = [np.log(np.maximum(p[: len(q.choices)], 1e-300)) for p, q in zip(p_sft, qs)]
        p_ts = np.array([np.pad(p, (0, p_sft.shape[1] - len(p))) for p in tempered(log_p, t)])
        out[f"{domain}/references"] = {"domain": domain, "way": "references", "temperature": t, "rows": {
            "uncalibrated": metrics_of(uncalibrated[domain], qs), "SFT": metrics_of(p_sft, qs),
            "SFT + temperature scaling": metrics_of(p_ts, qs)}}
        print(f"[{domain}/references] T = {t:.3f}: {out[f'{domain}/references']['rows']}", flush=True)
    save(out)


def save(out: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "label_free_loop.json").write_text(json.dumps(out, indent=1) + "\n")
    (RESULTS / "label_free_loop.md").write_text(table(out) + "\n")
    plot(out)


def table(out: dict) -> str:
    lines = ["| domain | way | accuracy | mean confidence | ECE-10 | AUROC | home accuracy | choices kept | confidence ρ |",
             "|---|---|---|---|---|---|---|---:|---:|"]
    for row in (r for r in out.values() if r["way"] != "references"):
        p, c = row["parent"], row["candidate"]
        arrow = lambda k: f"{p['held_out'][k]:.3f} → {c['held_out'][k]:.3f}"  # noqa: E731
        lines.append(f"| {row['domain']} | {row['way']} | {arrow('accuracy')} | {arrow('mean_confidence')} | "
                     f"{arrow('ece_10')} | {arrow('auroc')} | {p['home']['accuracy']:.3f} → {c['home']['accuracy']:.3f} | "
                     f"{row['label_free']['choice_agreement']:.3f} | {row['label_free']['confidence_spearman']:.3f} |")
    references = [r for r in out.values() if r["way"] == "references"]
    if references:
        lines += ["", "The same held-out questions under the reference models (SFT: the shipped recipe with method sft; "
                  f"temperature scaling fitted on the home split's labelled calibration questions, T = "
                  f"{references[0]['temperature']:.3f}):", "",
                  "| domain | model | accuracy | mean confidence | ECE-10 | AUROC |", "|---|---|---|---|---|---|"]
        for r in references:
            for name, m in r["rows"].items():
                lines.append(f"| {r['domain']} | {name} | {m['accuracy']:.3f} | {m['mean_confidence']:.3f} | "
                             f"{m['ece_10']:.3f} | {m['auroc']:.3f} |")
    return "\n".join(lines)


def plot(out: dict) -> None:
    """Per (domain, way): the held-out ECE and AUROC as arrows from the parent's to the candidate's."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in out.values() if r["way"] != "references"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.5), sharey=True)
    for ax, key, title in zip(axes, ("ece_10", "auroc"), ("ECE-10 (lower is better)", "AUROC (higher is better)")):
        for y, row in enumerate(rows):
            p, c = row["parent"]["held_out"][key], row["candidate"]["held_out"][key]
            ax.annotate("", xy=(c, y), xytext=(p, y), arrowprops={"arrowstyle": "->", "color": "tab:blue"})
            ax.plot([p], [y], "o", color="grey", markersize=4)
        values = [r[side]["held_out"][key] for r in rows for side in ("parent", "candidate")]
        margin = 0.05 * (max(values) - min(values))
        ax.set_xlim(min(values) - margin, max(values) + margin)  # arrows do not widen the axes themselves
        ax.set_title(f"held-out {title}, parent (dot) → candidate", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(rows)), [f"{r['domain']} / {r['way']}" for r in rows], fontsize=8)
    axes[0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(RESULTS / "label_free_loop.png", dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ways", default="atc,calm_head,calm,references")
    ap.add_argument("--domains", default="medicine,commonsense,stem")
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    args = ap.parse_args()
    path = RESULTS / "label_free_loop.json"
    out = json.loads(path.read_text()) if path.is_file() else {}
    model_path = str(resolve_model(None).path)
    ways = args.ways.split(",")
    for domain in args.domains.split(","):
        if set(ways) - {"references"}:
            run_domain(domain, [w for w in ways if w != "references"], args.data, model_path, out)
    if "references" in ways:
        run_references(args.domains.split(","), args.data, model_path, out)


if __name__ == "__main__":
    main()
