"""Metrics against hand-computed values and against independent implementations (torchmetrics, scikit-learn)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import brier_score_loss, log_loss, roc_auc_score
from torchmetrics.functional.classification import binary_calibration_error, multiclass_calibration_error

from calm_core import metrics as M

# Hand example: 4 samples, 2 classes.
HAND_PROBS = np.array([[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.2, 0.8]])
HAND_LABELS = np.array([0, 1, 1, 1])
# confidences 0.9, 0.6, 0.7, 0.8; correct T, F, T, T


def random_case(n=400, k=4, seed=0, sharp=3.0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, k)) * sharp
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    labels = np.where(rng.random(n) < 0.6, probs.argmax(1), rng.integers(0, k, n))
    return probs, labels


def test_ece_hand_computed():
    # 10 bins: 0.9 in (0.8,0.9], 0.6 in (0.5,0.6], 0.7 in (0.6,0.7], 0.8 in (0.7,0.8] -> one sample per bin.
    expected = (abs(1 - 0.9) + abs(0 - 0.6) + abs(1 - 0.7) + abs(1 - 0.8)) / 4
    assert M.ece(HAND_PROBS, HAND_LABELS, 10) == pytest.approx(expected)
    # 2 bins: (0,0.5] empty; (0.5,1] holds all: |0.75 - 0.75| = 0.
    assert M.ece(HAND_PROBS, HAND_LABELS, 2) == pytest.approx(0.0)


def test_brier_nll_accuracy_hand_computed():
    brier = ((0.1**2 + 0.1**2) + (0.6**2 + 0.6**2) + (0.3**2 + 0.3**2) + (0.2**2 + 0.2**2)) / 4
    assert M.brier(HAND_PROBS, HAND_LABELS) == pytest.approx(brier)
    assert M.nll(HAND_PROBS, HAND_LABELS) == pytest.approx(-np.mean(np.log([0.9, 0.4, 0.7, 0.8])))
    assert M.accuracy(HAND_PROBS, HAND_LABELS) == pytest.approx(0.75)


def test_auroc_and_aurc_hand_computed():
    conf, correct = M.top_label(HAND_PROBS, HAND_LABELS)
    # The one wrong answer (0.6) ranks below all three correct ones -> perfect separation.
    assert M.auroc(conf, correct) == pytest.approx(1.0)
    # Sorted by confidence 0.9 T, 0.8 T, 0.7 T, 0.6 F: risks 0, 0, 0, 1/4.
    assert M.aurc(conf, correct) == pytest.approx((0 + 0 + 0 + 0.25) / 4)
    # Ties count one half.
    assert M.auroc([0.5, 0.5], [True, False]) == pytest.approx(0.5)
    assert np.isnan(M.auroc([0.2, 0.9], [True, True]))


def test_adaptive_ece_hand_computed():
    # 2 equal-mass bins: {0.6 F, 0.7 T} -> |0.5 - 0.65|, {0.8 T, 0.9 T} -> |1 - 0.85|.
    assert M.adaptive_ece(HAND_PROBS, HAND_LABELS, 2) == pytest.approx((2 * 0.15 + 2 * 0.15) / 4)


def test_classwise_ece_hand_computed():
    # class 0: p = .9 .6 .3 .2, y = 1 0 0 0 ; class 1: p = .1 .4 .7 .8, y = 0 1 1 1 ; 10 bins, one sample per bin.
    c0 = (0.1 + 0.6 + 0.3 + 0.2) / 4
    c1 = (0.1 + 0.6 + 0.3 + 0.2) / 4
    assert M.classwise_ece(HAND_PROBS, HAND_LABELS, 10) == pytest.approx((c0 + c1) / 2)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n_bins", [10, 15])
def test_ece_matches_torchmetrics(seed, n_bins):
    probs, labels = random_case(seed=seed)
    ref = multiclass_calibration_error(torch.tensor(probs), torch.tensor(labels), num_classes=4, n_bins=n_bins, norm="l1")
    assert M.ece(probs, labels, n_bins) == pytest.approx(float(ref), abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_classwise_ece_matches_torchmetrics_per_class(seed):
    probs, labels = random_case(seed=seed, k=5)
    ref = np.mean([
        float(binary_calibration_error(torch.tensor(probs[:, k]), torch.tensor(labels == k).long(), n_bins=10))
        for k in range(5)
    ])
    assert M.classwise_ece(probs, labels, 10) == pytest.approx(ref, abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_brier_nll_auroc_match_sklearn(seed):
    probs, labels = random_case(seed=seed)
    assert M.brier(probs, labels) == pytest.approx(brier_score_loss(labels, probs, labels=[0, 1, 2, 3], scale_by_half=False))
    assert M.nll(probs, labels) == pytest.approx(log_loss(labels, probs, labels=[0, 1, 2, 3]), rel=1e-9)
    conf, correct = M.top_label(probs, labels)
    conf = np.round(conf, 2)  # create ties on purpose
    assert M.auroc(conf, correct) == pytest.approx(roc_auc_score(correct, conf))


def test_aurc_matches_bruteforce():
    probs, labels = random_case(seed=3, n=50)
    conf, correct = M.top_label(probs, labels)
    order = np.argsort(-conf)
    brute = np.mean([1 - correct[order[:k]].mean() for k in range(1, 51)])
    assert M.aurc(conf, correct) == pytest.approx(brute)


def test_perfectly_calibrated_sample_has_small_ece():
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.5, 1.0, 20000)
    correct = rng.random(20000) < conf
    assert M.binned_calibration_error(conf, correct, 10) < 0.01


def test_bootstrap_ci_brackets_the_estimate():
    probs, labels = random_case(seed=4)
    conf, correct = M.top_label(probs, labels)
    lo, hi = M.bootstrap_ci(M.auroc, conf, correct, n_boot=300, seed=0)
    est = M.auroc(conf, correct)
    assert lo < est < hi
    assert hi - lo < 0.2
    assert M.bootstrap_ci(M.auroc, conf, correct, n_boot=300, seed=0) == (lo, hi)  # seeded -> reproducible


def test_report_and_histogram():
    probs, labels = random_case(seed=5)
    r = M.calibration_report(probs, labels, n_boot=50)
    assert r.n == 400
    assert r.accuracy == pytest.approx(M.accuracy(probs, labels))
    assert r.ece_10 == pytest.approx(M.ece(probs, labels, 10))
    edges, counts = M.confidence_histogram(M.top_label(probs, labels)[0], 20)
    assert len(edges) == 21 and sum(counts) == 400


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: M.ece(HAND_PROBS, HAND_LABELS, 0), "`n_bins` to be a positive integer"),
        (lambda: M.ece(HAND_PROBS, HAND_LABELS, 2.5), "`n_bins` to be a positive integer"),
        (lambda: M.ece(HAND_PROBS[0], HAND_LABELS), "shape (N, K)"),
        (lambda: M.ece(HAND_PROBS, HAND_LABELS[:3]), "`labels` of shape (4,)"),
        (lambda: M.ece(HAND_PROBS, np.array([0, 1, 2, 1])), "`labels` in [0, 1]"),
        (lambda: M.ece(HAND_PROBS * 2, HAND_LABELS), "sum to 1"),
        (lambda: M.ece(HAND_PROBS, HAND_LABELS.astype(float)), "integer `labels`"),
    ],
)
def test_invalid_arguments_are_named(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        call()
