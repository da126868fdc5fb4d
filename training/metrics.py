"""Ranking metrics of a policy's scores against reuse labels.

- ``classification_metrics``: ROC-AUC, PR-AUC (average precision) and log loss of
  scores against ``reused_within_H`` labels. Log loss needs probabilities: learned
  policies give them; for rank-only scorers (LRU, LFU, the oracle) pass a calibrator
  fitted on the validation split (``fit_calibrator``, isotonic), so every policy's log
  loss is of a probability it could actually have produced without the test labels.
- ``top_k_metrics``: at each snapshot, keep the top k blocks by score (k = a cache of
  1%, 5%, 10% of the distinct blocks); precision = reused share of those k, recall =
  share of the snapshot's reused blocks that made the top k. Averaged over snapshots.
- ``harrell_davis_median``: the median as a weighted mean of every order statistic
  (TTFT tables report it beside the sample p50, which jumps across any gap in a few
  hundred requests' CDF when one request crosses the middle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import beta
from sklearn.isotonic import IsotonicRegression
from sklearn.metrics import average_precision_score, log_loss, roc_auc_score

TOP_K_FRACTIONS = (0.01, 0.05, 0.1)
"""Cache capacities (fractions of the distinct blocks) at which top-k is measured."""

PROBABILITY_EPS = 1e-6


def fit_calibrator(scores: np.ndarray, labels: np.ndarray) -> IsotonicRegression:
    """Monotone map from scores to probabilities, fitted on validation data."""
    iso = IsotonicRegression(y_min=PROBABILITY_EPS, y_max=1 - PROBABILITY_EPS, out_of_bounds="clip")
    iso.fit(scores.astype(np.float64), labels.astype(np.float64))
    return iso


def classification_metrics(
    labels: np.ndarray, scores: np.ndarray, probabilities: np.ndarray | None = None
) -> dict[str, float]:
    """ROC-AUC and PR-AUC of ``scores``; log loss of ``probabilities`` when given."""
    y = np.asarray(labels).astype(bool)
    s = np.asarray(scores, dtype=np.float64)
    out: dict[str, float] = {"positive_rate": float(y.mean()) if y.size else float("nan")}
    if y.size and 0 < y.sum() < y.size:
        out["roc_auc"] = float(roc_auc_score(y, s))
        out["pr_auc"] = float(average_precision_score(y, s))
    else:
        out["roc_auc"] = out["pr_auc"] = float("nan")
    if probabilities is not None and y.size:
        p = np.clip(
            np.asarray(probabilities, dtype=np.float64), PROBABILITY_EPS, 1 - PROBABILITY_EPS
        )
        out["log_loss"] = float(log_loss(y, p, labels=[False, True]))
    return out


@dataclass
class Snapshot:
    """Candidate blocks at one instant with their labels and one policy's scores."""

    labels: np.ndarray  # bool, reused within the horizon
    scores: np.ndarray  # float32


def top_k_metrics(
    snapshots: Sequence[Snapshot], capacities_blocks: dict[str, int]
) -> dict[str, float]:
    """Mean precision and recall at top-k over snapshots, one pair per capacity name.

    Ties at the k-th score are broken by candidate order (stable), so a constant scorer
    gets the base rate, not a lucky draw.
    """
    out: dict[str, float] = {}
    for cap_name, k in capacities_blocks.items():
        precisions, recalls = [], []
        for snap in snapshots:
            n = snap.scores.shape[0]
            if n == 0 or k <= 0:
                continue
            kk = min(k, n)
            top = np.argsort(-snap.scores.astype(np.float64), kind="stable")[:kk]
            hits = int(snap.labels[top].sum())
            precisions.append(hits / k)
            positives = int(snap.labels.sum())
            if positives:
                recalls.append(hits / positives)
        out[f"precision_at_{cap_name}"] = float(np.mean(precisions)) if precisions else float("nan")
        out[f"recall_at_{cap_name}"] = float(np.mean(recalls)) if recalls else float("nan")
    return out


def capacity_name(fraction: float) -> str:
    """``0.05`` -> ``"5pct"`` (metric names may not contain ``%`` or ``.`` everywhere)."""
    return f"{fraction * 100:g}pct".replace(".", "_")


def harrell_davis_median(values: np.ndarray) -> float:
    """Harrell and Davis's (1982) estimate of the median: the sorted sample weighted by
    the Beta((n+1)/2, (n+1)/2) mass of each order statistic's slot. It moves smoothly as
    single values cross the middle, where the sample median jumps to the next value (on
    a 673-request TTFT sample with a 100 ms gap at its middle, three requests crossing
    it moved the sample p50 by 2.5%). NaN for an empty sample."""
    x = np.sort(np.asarray(values, dtype=np.float64))
    n = x.size
    if n == 0:
        return float("nan")
    a = (n + 1) / 2.0
    weights = np.diff(beta.cdf(np.linspace(0.0, 1.0, n + 1), a, a))
    return float(weights @ x)
