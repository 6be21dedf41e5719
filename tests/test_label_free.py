"""How far a candidate moved from the serving version on unlabelled prompts (calm_core/label_free.py), the retraining
gate's label-free numbers."""

from __future__ import annotations

import numpy as np
import pytest

from calm_core.label_free import choice_movement, confidence_correlation
from calm_core.recalibration import tempered


def test_choice_movement_counts_changed_answers_and_reordered_confidences():
    rng = np.random.default_rng(3)
    active = rng.dirichlet(np.ones(4), size=200)
    same = choice_movement(active, active)
    assert same.choice_agreement == 1.0 and same.confidence_correlation == pytest.approx(1.0)
    flatter = np.array(tempered(list(np.log(active)), 2.0))  # one temperature: answers kept, ranking nearly
    moved = choice_movement(active, flatter)
    assert moved.choice_agreement == 1.0 and moved.confidence_correlation > 0.95
    shuffled = active[rng.permutation(200)]  # another version's answers altogether
    other = choice_movement(active, shuffled)
    assert other.choice_agreement < 0.5 and abs(other.confidence_correlation) < 0.2
    assert confidence_correlation([0.5, 0.5, 0.5], [0.1, 0.2, 0.3]) is None  # one version's confidence is constant
    with pytest.raises(ValueError, match="the same prompts"):
        choice_movement(active, active[:10])
