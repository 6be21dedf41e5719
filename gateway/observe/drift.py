"""Label-free drift of live confidences against an artifact's reference histogram (pure functions + a window).

PSI (population stability index) = Σ_b (live_b − ref_b) · ln(live_b / ref_b) over histogram bins, with a small
floor so empty bins stay finite; > 0.1 is usually read as a shift, > 0.25 as a large one.
KS = max_b |F_live(e_b) − F_ref(e_b)| over the bin edges: the two-sample Kolmogorov-Smirnov statistic, evaluated
at the reference's resolution.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

_FLOOR = 1e-4


def histogram_share(values, edges) -> np.ndarray:
    counts, _ = np.histogram(np.clip(np.asarray(values, dtype=np.float64), edges[0], edges[-1]), bins=edges)
    return counts / max(counts.sum(), 1)


def psi(live_share, ref_share, floor: float = _FLOOR) -> float:
    live = np.clip(np.asarray(live_share, dtype=np.float64), floor, None)
    ref = np.clip(np.asarray(ref_share, dtype=np.float64), floor, None)
    live, ref = live / live.sum(), ref / ref.sum()
    return float(((live - ref) * np.log(live / ref)).sum())


def ks(live_share, ref_share) -> float:
    return float(np.abs(np.cumsum(live_share) - np.cumsum(ref_share)).max())


@dataclass
class DriftReading:
    psi: float
    ks: float
    window: int
    mean_confidence: float


class ConfidenceWindow:
    """The last `size` calibrated confidences of one domain, compared with a reference histogram."""

    def __init__(self, ref_edges, ref_counts, size: int = 200):
        self.edges = np.asarray(ref_edges, dtype=np.float64)
        counts = np.asarray(ref_counts, dtype=np.float64)
        if self.edges.shape != (counts.size + 1,) or counts.sum() <= 0:
            raise ValueError("reference histogram needs len(edges) == len(counts) + 1 and a positive total")
        self.ref_share = counts / counts.sum()
        self.values: deque[float] = deque(maxlen=size)

    def add(self, confidence: float) -> DriftReading:
        self.values.append(float(confidence))
        return self.reading()

    def reading(self) -> DriftReading:
        if not self.values:
            return DriftReading(0.0, 0.0, 0, float("nan"))
        live = histogram_share(self.values, self.edges)
        return DriftReading(psi(live, self.ref_share), ks(live, self.ref_share), len(self.values), float(np.mean(self.values)))
