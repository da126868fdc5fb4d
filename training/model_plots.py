"""PNG figures of a trained model's evaluation: PR curves, calibration, importance.

Each returns a matplotlib figure (Agg backend) for ``TrackedRun.log_figure``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.metrics import precision_recall_curve  # noqa: E402

from training.evaluate import PolicyEvaluation  # noqa: E402


def pr_curve_figure(evaluations: Mapping[str, PolicyEvaluation]) -> Any:
    """Precision-recall on the test rows, one curve per policy."""
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, ev in evaluations.items():
        if ev.test_labels.size == 0 or ev.test_labels.sum() == 0:
            continue
        precision, recall, _ = precision_recall_curve(ev.test_labels, ev.test_probabilities)
        ax.plot(
            recall, precision, label=f"{name} (AP {ev.metrics.get('pr_auc', float('nan')):.3f})"
        )
    ax.set_xlabel("recall")
    ax.set_ylabel("precision")
    ax.set_title("Reuse within the horizon: precision-recall (test)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def calibration_figure(evaluation: PolicyEvaluation, num_bins: int = 15) -> Any:
    """Reliability diagram: mean predicted probability vs observed rate, per quantile bin."""
    p = evaluation.test_probabilities.astype(np.float64)
    y = evaluation.test_labels.astype(np.float64)
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], "k:", label="perfect")
    if p.size:
        edges = np.unique(np.quantile(p, np.linspace(0, 1, num_bins + 1)))
        which = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, max(len(edges) - 2, 0))
        xs = [p[which == b].mean() for b in range(len(edges) - 1) if np.any(which == b)]
        ys = [y[which == b].mean() for b in range(len(edges) - 1) if np.any(which == b)]
        ax.plot(xs, ys, "o-", label=evaluation.name)
    ax.set_xlabel("predicted probability")
    ax.set_ylabel("observed reuse rate")
    ax.set_title("Calibration (test)")
    ax.legend()
    fig.tight_layout()
    return fig


def importance_figure(importance: Mapping[str, float], top: int = 25) -> Any:
    """Horizontal bars of the ``top`` most important features."""
    items = sorted(importance.items(), key=lambda kv: kv[1], reverse=True)[:top]
    fig, ax = plt.subplots(figsize=(7, max(3.0, 0.28 * len(items) + 1)))
    ax.barh([k for k, _ in reversed(items)], [v for _, v in reversed(items)])
    ax.set_xlabel("importance")
    ax.set_title("Feature importance")
    fig.tight_layout()
    return fig
