"""Abstention thresholds with a guarantee, from labelled answers (pure functions over confidences and verdicts).

The promise: with probability at least 1 − δ over the labelled sample, the answers let through (confidence ≥ t) are
wrong at most a share α of the time, P(wrong | confidence ≥ t) ≤ α, for new answers exchangeable with the labelled
ones. The threshold comes from Learn-then-Test (Angelopoulos et al., 2022) as MAPIE implements it: "precision ≥ 1 − α"
of the rule "answer when confidence ≥ t", Hoeffding–Bentkus p-values, and fixed-sequence testing over a threshold grid
(steps of 0.01) from a start threshold down; the last threshold that passes is taken (the most answers kept).

Where the sequence starts decides its power: a threshold that almost no answer reaches cannot be shown safe, and the
sequence stops at the first failure. So it starts at the strictest threshold that a share `START_COVERAGE` of the
artifact's reference confidences reach (`start_from_reference`): the reference comes from the artifact's own held-out
questions, not from the labelled sample, so the choice does not touch the guarantee. Without a reference it starts
at 0.99.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

GRID = np.round(np.arange(0.99, -0.001, -0.01), 2)  # strictest first: the order fixed-sequence testing walks
START_COVERAGE = 0.05


@dataclass(frozen=True)
class RiskFit:
    """A guaranteed threshold and what it implies on the labelled answers it came from."""

    threshold: float | None  # None: no threshold on the grid keeps the promise (abstain on everything)
    target_risk: float
    delta: float
    n_labels: int
    coverage: float  # share of the labelled answers at or above the threshold (0 without one)
    selective_risk: float | None  # their error rate


def _check(confidence, correct, target_risk: float, delta: float) -> tuple[np.ndarray, np.ndarray]:
    conf = np.asarray(confidence, dtype=np.float64).ravel()
    ok = np.asarray(correct).ravel().astype(int)
    if conf.shape != ok.shape or conf.size == 0:
        raise ValueError(f"Expected as many confidences as verdicts (at least one), but got {conf.size} and {ok.size}")
    if not 0.0 < target_risk < 1.0 or not 0.0 < delta < 1.0:
        raise ValueError(f"Expected `target_risk` and `delta` in (0, 1), but got {target_risk} and {delta}")
    return conf, ok


def selective_risk(confidence, correct, threshold: float | None) -> tuple[float, float | None]:
    """(coverage, error rate among the answers with confidence ≥ threshold); no threshold lets nothing through."""
    conf, ok = np.asarray(confidence, dtype=np.float64), np.asarray(correct).astype(bool)
    if threshold is None:
        return 0.0, None
    kept = conf >= threshold
    return float(kept.mean()), (float(1.0 - ok[kept].mean()) if kept.any() else None)


def start_from_reference(bin_edges, counts, share: float = START_COVERAGE) -> float:
    """The strictest grid threshold that at least `share` of the reference confidences reach (0.99 without any)."""
    edges, counts = np.asarray(bin_edges, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    if counts.sum() <= 0:
        return float(GRID[0])
    # Share of the reference at or above each bin's lower edge; confidences inside a bin count as its lower edge.
    reach = np.cumsum(counts[::-1])[::-1] / counts.sum()
    lower = edges[:-1][reach >= share]
    return float(min(GRID[0], np.floor(lower.max() * 100) / 100)) if lower.size else float(GRID[0])


def sequence_start(reference: tuple[list[float], list[int]] | None) -> float:
    """Where the test sequence starts for an artifact's reference histogram (edges, counts); 0.99 without one."""
    return start_from_reference(*reference) if reference else float(GRID[0])


def guaranteed_threshold(confidence, correct, target_risk: float, delta: float, start: float = float(GRID[0])) -> RiskFit:
    """The smallest grid threshold t (at most `start`) with P(wrong | confidence ≥ t) ≤ target_risk, with probability
    at least 1 − delta."""
    from mapie.risk_control import BinaryClassificationController

    conf, ok = _check(confidence, correct, target_risk, delta)
    controller = BinaryClassificationController(
        predict_function=lambda x: np.column_stack([1.0 - np.ravel(x), np.ravel(x)]),
        risk="precision", target_level=1.0 - target_risk, confidence_level=1.0 - delta,
        list_predict_params=GRID[GRID <= start + 1e-9], fwer_method="fixed_sequence",
    )
    with warnings.catch_warnings():  # MAPIE warns when no threshold passes: that is an answer here, not a problem
        warnings.simplefilter("ignore", UserWarning)
        controller.calibrate(conf, ok)
    valid = controller.valid_predict_params
    threshold = float(np.min(valid)) if len(valid) else None
    coverage, risk = selective_risk(conf, ok, threshold)
    return RiskFit(threshold, target_risk, delta, int(conf.size), coverage, risk)


def oracle_threshold(confidence, correct, target_risk: float) -> float | None:
    """The smallest grid threshold whose error rate on these very answers is at most the target (no guarantee: the
    best any rule could do knowing the labels of the answers it is judged on)."""
    conf, ok = _check(confidence, correct, target_risk, 0.5)
    passing = [t for t in GRID if (r := selective_risk(conf, ok, t)[1]) is not None and r <= target_risk]
    return float(min(passing)) if passing else None


def risk_curve(confidence, correct) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(thresholds, coverage, selective risk) over the grid, for plots."""
    rows = [selective_risk(confidence, correct, t) for t in GRID]
    return GRID.copy(), np.array([c for c, _ in rows]), np.array([np.nan if r is None else r for _, r in rows])


def label_free_threshold(edges, counts, target_risk: float) -> float:
    """Smallest t whose estimated selective risk 1 − mean(conf | conf ≥ t) on reference confidences is at most
    target_risk, the confidences taken as spread evenly within each histogram bin; 1.0 if there are none. No labels:
    it holds only as far as the confidences are calibrated.

    Why inside the bins: with the threshold on bin edges it moved in steps of a tenth, and the answers it let through
    erred well below the target (0.40 for α = 0.45 on ARC-Easy after recalibration, benchmarks/loop/bench_recalibration.py);
    the exact t of the piecewise-uniform histogram keeps the promise as closely as the histogram allows."""
    edges = np.asarray(edges, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    centers = (edges[:-1] + edges[1:]) / 2
    keep = 1.0 - target_risk  # the mean confidence the kept answers need
    # Above edge b: count and confidence sum of bins b.. (the last entries: nothing kept, vacuously within the target).
    above_n = np.append(np.cumsum(counts[::-1])[::-1], 0.0)
    above_sum = np.append(np.cumsum((centers * counts)[::-1])[::-1], 0.0)
    within = above_sum >= keep * above_n - 1e-12
    first = int(np.argmax(within))  # risk only falls as t rises: the first edge within the target
    if above_n[0] <= 0:
        return 1.0
    if first == 0:
        return float(edges[0])
    # Inside bin b = first − 1 (not empty, else edge b would be within the target too): keeping its top u of width w
    # adds n·u/w answers of mean confidence hi − u/2; the kept mean reaches `keep` at the root of
    # −n/(2w)·u² + n/w·(hi − keep)·u + (S − keep·N) = 0, S and N the sum and count above hi (g(0) ≥ 0 > g(w)).
    b = first - 1
    lo, hi, n = edges[b], edges[b + 1], counts[b]
    w = hi - lo
    qa, qb, qc = -n / (2 * w), n / w * (hi - keep), above_sum[first] - keep * above_n[first]
    u = (-qb - np.sqrt(max(qb * qb - 4 * qa * qc, 0.0))) / (2 * qa)
    u = min(max(u, 0.0), w)
    kept = n * u / w + above_n[first]
    return float(hi - u) if kept > 1e-9 else 1.0  # nothing would be answered: abstain on everything
