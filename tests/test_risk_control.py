"""Guaranteed abstention thresholds (Learn-then-Test through MAPIE): unit checks on synthetic answers, and the
validity check on real scores of the shipped artifact (`reports/policy-arc-easy/scores.npz`, written by
`calm policy fit`; a slow test re-scores a sample of those questions and checks the file is what the artifact says)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binom

from calm_core.risk_control import (
    guaranteed_threshold, label_free_threshold, oracle_threshold, selective_risk, start_from_reference,
)
from tests.recorded import results_dir

REPO = Path(__file__).resolve().parents[1]
SCORES = REPO / "reports" / "policy-arc-easy"
ALPHA, DELTA, N_LABELLED, SPLITS = 0.45, 0.1, 300, 500


def synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Calibrated answers: confidence uniform on [0.2, 1], right with that probability."""
    rng = np.random.default_rng(seed)
    conf = rng.uniform(0.2, 1.0, n)
    return conf, rng.uniform(size=n) < conf


def test_the_threshold_keeps_the_promise_on_its_own_labels_and_is_monotone_in_the_target():
    conf, correct = synthetic(1000, 0)
    loose, strict = (guaranteed_threshold(conf, correct, a, 0.1, start=0.9) for a in (0.3, 0.15))
    assert loose.threshold is not None and strict.threshold is not None
    assert strict.threshold > loose.threshold  # a smaller risk needs a stricter threshold
    for fit in (loose, strict):
        assert fit.selective_risk <= fit.target_risk and 0 < fit.coverage < 1 and fit.n_labels == 1000
        assert (fit.coverage, fit.selective_risk) == selective_risk(conf, correct, fit.threshold)


def test_no_threshold_when_the_promise_cannot_be_kept():
    conf, correct = synthetic(300, 1)
    impossible = guaranteed_threshold(conf, np.zeros_like(correct), 0.2, 0.1, start=0.9)  # every answer wrong
    assert impossible.threshold is None and impossible.coverage == 0.0 and impossible.selective_risk is None
    with pytest.raises(ValueError, match="as many confidences"):
        guaranteed_threshold(conf, correct[:-1], 0.2, 0.1)
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        guaranteed_threshold(conf, correct, 1.2, 0.1)


def test_sequence_start_and_label_free_threshold_from_a_reference_histogram():
    edges = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    counts = [0, 0, 495, 588, 69, 5, 2, 1, 0, 0]  # the shipped artifact's science reference
    assert start_from_reference(edges, counts) == 0.4  # 6.6 % reach 0.4, 0.7 % reach 0.5
    assert start_from_reference(edges, [0] * 10) == 0.99
    # 1 − mean(conf | conf ≥ t), with bin centres: all answers 0.3 → t = 0.2 keeps it at 0.7.
    assert label_free_threshold(edges, [0, 0, 0, 10, 0, 0, 0, 0, 0, 0], 0.7) == 0.0
    assert label_free_threshold(edges, [0, 0, 0, 10, 0, 0, 0, 0, 0, 0], 0.5) == 1.0
    assert label_free_threshold(edges, [0] * 10, 0.5) == 1.0


def _estimated_risk(edges, counts, t: float) -> float:
    """1 − mean(conf | conf ≥ t) with each bin's answers spread evenly over it (by brute force on a fine grid)."""
    points = np.concatenate([np.linspace(lo, hi, 20001)[:-1] + (hi - lo) / 40000 for lo, hi in zip(edges, edges[1:])])
    weights = np.repeat(np.asarray(counts, dtype=float), 20000)
    kept = points >= t
    return 1.0 - float((points * weights)[kept].sum() / weights[kept].sum())


def test_the_label_free_threshold_is_where_the_histograms_estimated_risk_meets_the_target():
    """Not on a bin edge: the smallest t whose estimated risk is at most the target, inside its bin."""
    edges = list(np.linspace(0, 1, 11))
    rng = np.random.default_rng(3)
    for _ in range(20):
        counts = rng.integers(1, 30, 10) * (rng.random(10) < 0.8)
        target = float(rng.uniform(0.05, 0.5))
        t = label_free_threshold(edges, counts, target)
        if t == 1.0:  # no t keeps the promise: even the best bin's top answers are not confident enough
            assert _estimated_risk(edges, counts, edges[int(np.flatnonzero(counts)[-1]) + 1] - 1e-4) > target - 1e-3
            continue
        assert _estimated_risk(edges, counts, t) <= target + 1e-3
        if t > 0:
            assert _estimated_risk(edges, counts, t - 0.01) > target


def test_guarantee_holds_over_random_splits_of_synthetic_answers():
    conf, correct = synthetic(2000, 2)
    rng = np.random.default_rng(3)
    violations = 0
    for _ in range(200):
        order = rng.permutation(conf.size)
        fit = guaranteed_threshold(conf[order[:300]], correct[order[:300]], 0.25, 0.1, start=0.9)
        _, risk = selective_risk(conf[order[300:]], correct[order[300:]], fit.threshold)
        violations += risk is not None and risk > 0.25
    assert violations / 200 <= 0.1 + 3 * np.sqrt(0.1 * 0.9 / 200)


def validity(conf: np.ndarray, correct: np.ndarray, start: float, label_free: float) -> dict:
    """Over random splits into N_LABELLED labelled answers and a test part: how often the test part's error rate among
    the answers let through exceeds α, for the guaranteed and the label-free threshold, and their coverage next to
    the oracle's (the best threshold knowing the test labels)."""
    rng = np.random.default_rng(0)
    rows = {"guaranteed": [], "label_free": [], "oracle": []}
    for _ in range(SPLITS):
        order = rng.permutation(conf.size)
        lab, test = order[:N_LABELLED], order[N_LABELLED:]
        fit = guaranteed_threshold(conf[lab], correct[lab], ALPHA, DELTA, start=start)
        oracle = oracle_threshold(conf[test], correct[test], ALPHA)
        for name, t in (("guaranteed", fit.threshold), ("label_free", label_free), ("oracle", oracle)):
            coverage, risk = selective_risk(conf[test], correct[test], t)
            rows[name].append((coverage, risk is not None and risk > ALPHA))
    return {name: {"coverage": float(np.mean([c for c, _ in r])), "violations": float(np.mean([v for _, v in r]))}
            for name, r in rows.items()}


def test_guarantee_holds_on_the_shipped_artifacts_real_scores():
    """≥ 500 random splits of 2,376 held-out ARC-Easy answers of the shipped artifact: the guaranteed threshold breaks
    the promise in at most δ of them (plus binomial slack); the label-free threshold is measured beside it."""
    data = np.load(SCORES / "scores.npz")
    fit = json.loads((SCORES / "fit.json").read_text())
    conf, correct = data["confidence"], data["correct"].astype(bool)
    result = validity(conf, correct, fit["sequence_start"], fit["label_free"]["threshold"])
    slack = binom.ppf(0.999, SPLITS, DELTA) / SPLITS - DELTA  # 99.9 % upper bound of a δ-rate over the splits
    assert result["guaranteed"]["violations"] <= DELTA + slack, result
    assert 0 < result["guaranteed"]["coverage"] <= result["oracle"]["coverage"], result
    (results_dir() / "risk_validity.json").write_text(json.dumps({"alpha": ALPHA, "delta": DELTA, "labelled": N_LABELLED,
                                                      "splits": SPLITS, "slack": slack, **result}, indent=2))


@pytest.mark.slow
def test_the_scores_file_is_the_shipped_artifacts_own(shipped_artifact, embedded_model_dir, shared_data):
    """Re-score 24 of the questions behind scores.npz with the shipped artifact: the same confidences (1e-5)."""
    from calm_core.data import load_mc
    from training.artifact_scoring import load_served_model, option_probabilities
    from training.scoring import load_tokenizer

    data = np.load(SCORES / "scores.npz")
    by_id = {q.id: q for q in load_mc("arc_easy", "test", root=shared_data)}
    idx = np.random.default_rng(0).choice(len(data["question_ids"]), 24, replace=False)
    questions = [by_id[str(data["question_ids"][i])] for i in idx]
    model = load_served_model(str(embedded_model_dir), shipped_artifact.adapter_dir)
    probs = option_probabilities(model, load_tokenizer(str(embedded_model_dir)), questions, "cloze", shipped_artifact.head)
    np.testing.assert_allclose(probs.max(axis=1), data["confidence"][idx], atol=1e-5)
    assert ((probs.argmax(axis=1) == [q.answer for q in questions]) == data["correct"][idx]).all()
