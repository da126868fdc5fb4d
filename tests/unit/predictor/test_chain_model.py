"""The chain return-time model on a generated trace whose sessions return after a known
gap (the ``planted`` profile: every chat turn comes back exactly 45 s later, scans in
between). Ranking live chains by P(continues within 10 s) must beat ranking them by
recency (time since their last turn) by a wide margin: recency puts the chains about
to return (idle ~35-45 s) below every chain used since."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from predictor.chain_model import ChainPolicy, ChainTracker, chain_dataset
from training.replay import split_events

from .conftest import generated_events

HORIZON_MS = 10_000
MARGIN = 0.3
"""ROC-AUC the chain model must gain over recency on held-out chains."""


@pytest.fixture(scope="module")
def fitted():
    train, test = split_events(generated_events("planted", 1_500, seed=1), 0.6)
    policy = ChainPolicy(ChainPolicy.Params(horizon_ms=HORIZON_MS)).fit(train)
    return policy, train, test


def test_chain_model_ranks_returning_chains_far_better_than_recency(fitted):
    policy, _, test = fitted
    x, returned, since_ms = chain_dataset(test, HORIZON_MS)
    assert returned.sum() > 50 and (~returned).sum() > 50
    model_auc = roc_auc_score(returned, policy.booster.predict(x))
    recency_auc = roc_auc_score(returned, -since_ms)
    assert model_auc >= recency_auc + MARGIN, (model_auc, recency_auc)


def test_tracker_follows_turns_through_the_partial_last_block():
    tracker = ChainTracker()
    # Turn 2 re-reads turn 1's full blocks (1, 2); turn 1's partial last block (3)
    # comes back under another id (4) with more tokens.
    for ts, blocks in ((0, (1, 2, 3)), (45_000, (1, 2, 4, 5, 6)), (90_000, (1, 2, 4, 5, 7, 8))):
        from features.events import BlocksAccessed

        tracker.observe(BlocksAccessed(ts, f"r{ts}", blocks, 16))
    assert list(tracker.chains) == [8]
    chain = tracker.chains[8]
    assert chain.turns == 3 and chain.last_think_ms == 45_000 and chain.prev_length == 5


def test_policy_scores_blocks_by_their_chain_and_offers_prefetch_candidates(fitted):
    policy, train, _ = fitted
    policy.observe_many(train)
    now_ms = train[-1].ts_ms + 1
    blocks = np.fromiter(policy.tracker.latest_leaf, dtype=np.uint64)[-500:]
    scores = policy.score(blocks, now_ms)
    assert scores.dtype == np.float32 and scores.shape == blocks.shape
    assert np.all((scores >= 0) & (scores <= 1))
    assert policy.score(np.array([2**63 + 7], dtype=np.uint64), now_ms)[0] == 0.0
    candidates = policy.prefetch_candidates(now_ms, 64)
    assert 0 < candidates.shape[0] <= 64 and candidates.dtype == np.uint64


def test_candidates_come_from_the_most_recent_chains_only(fitted):
    policy, train, _ = fitted
    narrow = policy.fresh_copy()
    narrow.params = narrow.params.model_copy(update={"candidate_chains": 3})
    narrow.observe_many(train)
    now_ms = train[-1].ts_ms + 1
    recent = list(narrow.tracker.chains)[-3:]
    allowed = {b for leaf in recent for b in narrow.tracker.chains[leaf].blocks}
    candidates = set(narrow.prefetch_candidates(now_ms, 10_000).tolist())
    assert candidates and candidates <= allowed
    assert policy.fresh_copy().booster is policy.booster and not policy.fresh_copy().tracker.chains


def test_learned_policies_carry_the_chain_model_and_offer_its_candidates():
    from training.train import fit_policy_on_events

    train, _ = split_events(generated_events("planted", 1_500, seed=1), 0.6)
    model = fit_policy_on_events("lightgbm", train, quick=True, horizon_ms=HORIZON_MS)
    assert model.chain is not None and model.chain.params.horizon_ms == HORIZON_MS
    copy = model.fresh_copy()
    assert copy.chain is not None and copy.chain is not model.chain
    assert copy.prefetch_candidates(0, 64).shape == (0,)  # nothing observed yet
    copy.observe_many(train)
    now_ms = train[-1].ts_ms + 1
    expected = copy.chain.prefetch_candidates(now_ms, 64)
    assert expected.shape[0] > 0
    assert np.array_equal(copy.prefetch_candidates(now_ms, 64), expected)


def test_chain_features_by_column_equal_the_row_definition_and_scores_are_lightgbms(fitted):
    """``features`` column by column (numpy, many chains) is bit-identical to
    ``features_row`` (Python scalars, what a few chains take), out-of-order turns
    (negative think times) included; ``predict_chains`` (compiled trees) equals
    ``Booster.predict`` within 1e-6."""
    policy, _, test = fitted
    chain = policy.fresh_copy()
    events = list(test)
    # A turn that arrives before its parent's last one: a negative think time.
    late = events[-1]
    events.append(dataclasses.replace(late, ts_ms=late.ts_ms - 5_000, request_id="x"))
    for event in events:
        chain.observe(event)
    leaves = list(chain.tracker.chains)
    now = events[-1].ts_ms + 2_500
    rows = np.array([chain.tracker.features_row(leaf, now) for leaf in leaves], np.float32)
    assert len(leaves) > 32  # the column path, below the row path
    np.testing.assert_array_equal(chain.tracker.features_by_column(leaves, now), rows)
    np.testing.assert_array_equal(chain.tracker.features(leaves, now), rows)
    np.testing.assert_array_equal(chain.tracker.features(leaves[:5], now), rows[:5])
    assert chain.tracker.features([], now).shape == (0, rows.shape[1])
    expected = chain.booster.predict(rows, num_threads=1)
    got = chain.predict_chains(leaves, now)
    assert chain.model is not None and chain.model.compiled is not None  # what scored
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)


def test_chain_predictions_are_reused_until_the_chain_moves_on_or_they_expire(fitted):
    policy, train, test = fitted
    policy = policy.fresh_copy()
    policy.observe_many(train)
    predicted: list[int] = []
    exact = policy.predict_chains

    def counting(leaves, now_ms):
        predicted.append(len(leaves))
        return exact(leaves, now_ms)

    def rows_predicted(now_ms: int, max_age_ms: int = 10_000) -> int:
        predicted.clear()
        policy.prefetch_candidates(now_ms, 256, max_age_ms)
        return sum(predicted)

    policy.predict_chains = counting  # type: ignore[method-assign]
    now_ms = train[-1].ts_ms + 1
    n = min(len(policy.tracker.chains), policy.params.candidate_chains)
    first = policy.prefetch_candidates(now_ms, 256, 10_000)
    assert sum(predicted) == n
    # Same time, nothing new: every prediction is reused, and the ranking is the exact one.
    assert rows_predicted(now_ms) == 0
    assert np.array_equal(first, policy.prefetch_candidates(now_ms, 256, 10_000))
    assert np.array_equal(first, policy.prefetch_candidates(now_ms, 256))
    assert rows_predicted(now_ms, 0) == n  # 0: every chain, every time
    assert rows_predicted(now_ms) == n  # (which keeps nothing)
    # A new turn: only the chain it made or continued is predicted.
    policy.observe(dataclasses.replace(test[0], ts_ms=now_ms + 1))
    assert rows_predicted(now_ms + 1) == 1
    # Predictions expire between max_age / 2 and max_age after they were made.
    assert rows_predicted(now_ms + 10_000 // 2 - 1) == 0
    assert rows_predicted(now_ms + 10_000 + 2) == n


def test_chain_prediction_expiry_is_spread_over_half_to_all_of_the_age():
    from predictor.chain_model import expiry_ms

    leaves = np.arange(1, 20_001, dtype=np.uint64) * np.uint64(7_919)
    ages = expiry_ms(leaves, 10_000)
    assert ages.min() >= 5_000 and ages.max() <= 10_000
    # Spread, not bunched: each tenth of the range holds roughly a tenth of the leaves.
    counts = np.histogram(ages, bins=10, range=(5_000, 10_000))[0]
    assert counts.min() > 0.07 * len(leaves)
    assert np.array_equal(ages, expiry_ms(leaves, 10_000))  # deterministic
