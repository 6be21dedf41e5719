"""The shipped free-form mode on two PopQA subsets, as served (vLLM in process, greedy answers of at most 48 tokens,
token confidence): the 200 questions about its least popular subjects, and the 200 least popular of its questions
about who directed, wrote, produced or composed a work (the free-form loop test's traffic). Accuracy, mean
confidence, ECE-10 and AUROC, and the drift PSI of the first 100 answers against the shipped reference histograms of
the `trivia` and `entity_knowledge` domains (what the gateway's drift gauge would read).

    python benchmarks/scoring/free_form_subsets.py          # -> benchmarks/results/free_form_subsets.md
    python benchmarks/scoring/free_form_subsets.py --by-relation   # and each PopQA relation (prop) on its own
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

CREDITS = ("director", "screenwriter", "producer", "author", "composer")  # tests/test_retrain_loop_free_form.py


def main() -> None:
    from adapters.clients.inprocess import artifact_engine
    from calm_core.artifact import load_artifact
    from calm_core.data import load_open
    from calm_core.models import resolve_model
    from calm_core.paths import BUNDLED_DIR
    from gateway.observe.drift import histogram_share, psi
    from training.free_form_eval import evaluate_sets, free_form_metrics

    shipped = BUNDLED_DIR / "artifacts" / "smollm2-135m-instruct"
    questions = load_open("popqa", "test") + load_open("popqa", "dev")
    by_popularity = sorted(questions, key=lambda q: (q.extra["s_pop"], q.id))
    sets = {"least popular subjects": by_popularity[:200],
            "credits, least popular": [q for q in by_popularity if q.extra["prop"] in CREDITS][:200]}
    if "--by-relation" in sys.argv:  # each relation's questions (at most 120, in a fixed order): where it is right
        for prop in sorted({q.extra["prop"] for q in questions}):
            sets[f"relation `{prop}`"] = sorted((q for q in questions if q.extra["prop"] == prop), key=lambda q: q.id)[:120]
    records = evaluate_sets(artifact_engine, resolve_model(None).path, shipped / "free_form", sets, samples=0)
    references = load_artifact(shipped).manifest.reference_histograms
    lines = ["| PopQA subset | n | accuracy | mean confidence | ECE-10 | AUROC | PSI vs `trivia` | PSI vs `entity_knowledge` |",
             "|---|---|---|---|---|---|---|---|"]
    for name, recs in records.items():
        m = free_form_metrics(recs)
        conf = np.array([r.token_confidence for r in recs[:100]])
        drift = [psi(histogram_share(conf, references[d].bin_edges), np.array(references[d].counts) /
                     sum(references[d].counts)) for d in ("trivia", "entity_knowledge")]
        auroc = f"{m['auroc']:.3f}" if np.isfinite(m["auroc"]) else "–"
        lines.append(f"| {name} | {len(recs)} | {m['accuracy']:.3f} | {m['mean_confidence']:.3f} | {m['ece_10']:.3f} | "
                     f"{auroc} | {drift[0]:.2f} | {drift[1]:.2f} |")
    out = Path(__file__).resolve().parents[1] / "results" / "free_form_subsets.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
