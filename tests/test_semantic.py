"""The semantic-confidence map: smoothing, the Platt fit on labels or on another calibrated probability (pure math)."""

from __future__ import annotations

import numpy as np
import pytest

from calm_core.semantic import SemanticCalibration, fit_platt, smoothed_share


def test_smoothed_share_never_reaches_zero_or_one():
    assert smoothed_share(0, 8) == pytest.approx(0.5 / 9) and smoothed_share(8, 8) == pytest.approx(8.5 / 9)
    assert SemanticCalibration().confidence(4, 8) == pytest.approx(0.5)  # unfitted: the smoothed share itself
    with pytest.raises(ValueError):
        smoothed_share(9, 8)


def test_platt_fit_recovers_the_map_that_generated_the_labels():
    rng = np.random.default_rng(0)
    agreeing = rng.integers(0, 9, size=20000)
    shares = np.array([smoothed_share(int(k), 8) for k in agreeing])
    truth = SemanticCalibration(slope=0.6, intercept=-1.5)
    labels = rng.random(len(shares)) < [truth.confidence(int(k), 8) for k in agreeing]
    slope, intercept = fit_platt(shares, labels.astype(float))
    assert slope == pytest.approx(0.6, abs=0.05) and intercept == pytest.approx(-1.5, abs=0.05)


def test_label_free_fit_onto_a_probability_matches_its_mean_and_keeps_the_ranking():
    shares = np.array([smoothed_share(k, 8) for k in (0, 0, 1, 2, 5, 8)])
    token_confidence = np.array([0.05, 0.1, 0.1, 0.2, 0.3, 0.4])  # a calibrated, lower level of confidence
    slope, intercept = fit_platt(shares, token_confidence)
    fitted = SemanticCalibration(slope=slope, intercept=intercept)
    mapped = np.array([fitted.confidence(k, 8) for k in (0, 0, 1, 2, 5, 8)])
    assert mapped.mean() == pytest.approx(token_confidence.mean(), abs=1e-6)  # the cross-entropy optimum's moment
    assert np.all(np.diff(mapped) >= 0) and slope > 0


def test_a_set_where_every_share_is_equal_still_fits_and_bad_targets_are_refused():
    slope, intercept = fit_platt([0.5] * 10, [0.0] * 9 + [1.0])
    assert SemanticCalibration(slope=slope, intercept=intercept).confidence(4, 8) == pytest.approx(0.1, abs=1e-3)
    with pytest.raises(ValueError):
        fit_platt([0.5], [1.5])
    with pytest.raises(ValueError):
        fit_platt([], [])
