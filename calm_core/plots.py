"""Reliability diagrams as PNG (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from calm_core.metrics import binned_calibration_error  # noqa: E402


def reliability_diagram(
    panels: dict[str, tuple[np.ndarray, np.ndarray]],
    path: str | Path,
    n_bins: int = 10,
    title: str = "Reliability diagram",
) -> Path:
    """One panel per name: bars of accuracy per equal-width confidence bin against the diagonal.

    `panels` maps a name to (confidence, correct).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = len(panels)
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    edges = np.linspace(0, 1, n_bins + 1)
    centers = (edges[:-1] + edges[1:]) / 2
    for ax, (name, (conf, correct)) in zip(axes.flat, panels.items()):
        conf = np.asarray(conf, dtype=float)
        correct = np.asarray(correct, dtype=bool)
        idx = np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, n_bins - 1)
        acc = np.array([correct[idx == b].mean() if (idx == b).any() else np.nan for b in range(n_bins)])
        counts = np.bincount(idx, minlength=n_bins)
        ax.bar(centers, np.nan_to_num(acc), width=1 / n_bins, edgecolor="black", alpha=0.7, label="accuracy")
        ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect")
        ax2 = ax.twinx()
        ax2.plot(centers, counts / counts.sum(), "o-", color="tab:red", ms=3, label="share of answers")
        ax2.set_ylim(0, 1)
        ax2.set_yticks([])
        ece10 = binned_calibration_error(conf, correct, n_bins)
        ax.set_title(f"{name}\nacc {correct.mean():.2f}  ECE {ece10:.3f}", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("confidence")
        ax.set_ylabel("accuracy")
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
