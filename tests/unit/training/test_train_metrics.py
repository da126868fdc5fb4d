"""Ranking metrics, worked out by hand on tiny inputs."""

from __future__ import annotations

import math

import click
import numpy as np
import pytest

from training.metrics import (
    Snapshot,
    capacity_name,
    classification_metrics,
    fit_calibrator,
    top_k_metrics,
)
from training.train_cli import parse_duration_ms


def test_auc_of_a_perfect_and_a_reversed_ranking():
    y = np.array([0, 0, 1, 1], dtype=bool)
    assert classification_metrics(y, np.array([0.1, 0.2, 0.8, 0.9]))["roc_auc"] == 1.0
    assert classification_metrics(y, np.array([0.9, 0.8, 0.2, 0.1]))["roc_auc"] == 0.0
    # One positive ranked below one negative: 3 of 4 pairs right.
    m = classification_metrics(y, np.array([0.1, 0.5, 0.4, 0.9]))
    assert m["roc_auc"] == pytest.approx(0.75)
    # AP: positives at ranks 1 and 3 -> (1/1 + 2/3) / 2.
    assert m["pr_auc"] == pytest.approx((1 + 2 / 3) / 2)


def test_log_loss_only_with_probabilities():
    y = np.array([1, 0], dtype=bool)
    assert "log_loss" not in classification_metrics(y, np.array([0.7, 0.2]))
    m = classification_metrics(y, np.array([0.7, 0.2]), probabilities=np.array([0.7, 0.2]))
    assert m["log_loss"] == pytest.approx(-(math.log(0.7) + math.log(0.8)) / 2)


def test_single_class_gives_nan_auc_not_an_error():
    m = classification_metrics(np.zeros(3, bool), np.array([0.1, 0.2, 0.3]))
    assert math.isnan(m["roc_auc"]) and math.isnan(m["pr_auc"])


def test_top_k_precision_and_recall_per_snapshot_then_mean():
    snaps = [
        # top 2 = blocks 3, 0 -> one reused of 2; reused total 2 -> recall 1/2
        Snapshot(
            labels=np.array([0, 1, 0, 1], bool), scores=np.array([0.5, 0.1, 0.2, 0.9], np.float32)
        ),
        # top 2 = blocks 0, 1 -> both reused; reused total 2 -> recall 1
        Snapshot(labels=np.array([1, 1, 0], bool), scores=np.array([0.9, 0.8, 0.1], np.float32)),
    ]
    m = top_k_metrics(snaps, {"two": 2})
    assert m["precision_at_two"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["recall_at_two"] == pytest.approx((0.5 + 1.0) / 2)


def test_top_k_ties_are_not_lucky():
    # A constant scorer keeps the first k in candidate order, whatever the labels.
    snap = Snapshot(labels=np.array([0, 0, 1, 1], bool), scores=np.zeros(4, np.float32))
    assert top_k_metrics([snap], {"k": 2})["precision_at_k"] == 0.0


def test_calibrator_is_monotone_and_bounded():
    scores = np.array([-5, -4, -3, -2, -1], dtype=np.float32)
    labels = np.array([0, 0, 1, 0, 1], dtype=bool)
    p = fit_calibrator(scores, labels).predict(np.array([-10.0, -3.5, 0.0]))
    assert np.all(np.diff(p) >= 0) and p.min() > 0 and p.max() < 1


def test_names_and_durations():
    assert (
        capacity_name(0.01) == "1pct"
        and capacity_name(0.05) == "5pct"
        and capacity_name(0.1) == "10pct"
    )
    assert parse_duration_ms("60s") == 60_000
    assert parse_duration_ms("2m") == 120_000
    assert parse_duration_ms("45000ms") == 45_000
    with pytest.raises(click.BadParameter, match="no unit"):
        parse_duration_ms("45000")  # a bare number is refused, not read as ms
    assert parse_duration_ms("1.5s") == 1_500


def test_the_harrell_davis_median_moves_smoothly_where_the_sample_median_jumps():
    from training.metrics import harrell_davis_median

    # Symmetric samples: both estimates are the middle.
    assert harrell_davis_median(np.arange(1.0, 102.0)) == pytest.approx(51.0)
    assert np.isnan(harrell_davis_median(np.array([])))
    # 673 TTFTs with a 100 ms gap at the middle: one request crossing it moves the
    # sample median across the whole gap, the Harrell-Davis median by a small part of it.
    rng = np.random.default_rng(0)
    low, high = rng.uniform(3000, 4000, 337), rng.uniform(4100, 5000, 336)
    before = np.concatenate([low, high])
    after = np.concatenate([np.sort(low)[:-1], [4990.0], high])
    jump = np.median(after) - np.median(before)
    smooth = harrell_davis_median(after) - harrell_davis_median(before)
    assert jump > 100 and 0 < smooth < jump / 4


def test_paired_ttft_counts_requests_faster_and_slower_than_the_base():
    from training.report import paired_ttft

    base = np.array([100.0, 100.0, 100.0, 100.0])
    got = paired_ttft(np.array([50.0, 100.5, 130.0, 100.0]), base)
    assert got["faster"] == 1 and got["slower"] == 1  # 100.5 is within 1%
    assert got["mean_change"] == pytest.approx(380.5 / 400 - 1)
    assert paired_ttft(np.array([1.0]), base) == {}


def test_the_p50_ratio_interval_spans_one_for_a_crossing_and_not_for_a_real_shift():
    from training.report import p50_ratio_interval

    rng = np.random.default_rng(1)
    base = np.concatenate([rng.uniform(3000, 4000, 337), rng.uniform(4100, 5000, 336)])
    same = p50_ratio_interval(base, base)
    assert same == (1.0, 1.0)
    # Two requests just below the gap moved above it: the p50 jumps by ~2.5%...
    crossed = base.copy()
    crossed[np.argsort(base)[335:337]] = 4990.0
    assert np.median(crossed) / np.median(base) > 1.02
    lo, hi = p50_ratio_interval(crossed, base)
    assert lo <= 1.0 < 1.02 < hi  # ...and the interval says 673 requests cannot tell
    # Every request 10% slower: the interval is tight around 1.1.
    lo, hi = p50_ratio_interval(base * 1.1, base)
    assert lo == pytest.approx(1.1) and hi == pytest.approx(1.1)
    # Seeded: the same inputs give the same interval; chunks do not change it.
    assert p50_ratio_interval(crossed, base) == p50_ratio_interval(crossed, base)
    assert np.isnan(p50_ratio_interval(base, base[:10])[0])


def test_the_hit_difference_interval_follows_runs_of_requests_and_spans_zero_only_for_noise():
    from training.report import hit_difference_interval

    rng = np.random.default_rng(2)
    accesses = rng.integers(5, 40, 600)
    base = rng.binomial(accesses, 0.3)
    assert hit_difference_interval(base, base, accesses) == (0.0, 0.0)
    # One more hit in every request of 20 blocks: the difference is exactly 1/20.
    twenty = np.full(600, 20)
    lo, hi = hit_difference_interval(base + 1, base, twenty)
    assert lo == pytest.approx(0.05) and hi == pytest.approx(0.05)
    # Ahead in the first half, behind by as much in the second: the point difference
    # is 0 and the interval must span it (requests resampled in runs of 50 carry the
    # halves' correlation; one by one they would too, a fortiori).
    swing = base + np.where(np.arange(600) < 300, 2, -2)
    lo, hi = hit_difference_interval(swing, base, accesses)
    assert lo < 0.0 < hi
    # A small real lead against binomial noise: the interval is above 0 and holds the
    # point difference.
    better = rng.binomial(accesses, 0.36)
    point = (better.sum() - base.sum()) / accesses.sum()
    lo, hi = hit_difference_interval(better, base, accesses)
    assert 0.0 < lo <= point <= hi
    assert hit_difference_interval(better, base, accesses) == (lo, hi)  # seeded
    assert np.isnan(hit_difference_interval(better, base[:10], accesses)[0])
