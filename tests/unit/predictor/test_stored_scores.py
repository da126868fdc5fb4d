"""Score once, keep the score (issue 13): a learned policy's scores read back from the
feature state equal scores computed fresh for the same block at the same time, within
the refresh rule (void on access, at most ``score_max_age_ms`` old)."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np

from predictor.learned import LearnedPolicy


def _with_max_age(policy: LearnedPolicy, max_age_ms: int) -> LearnedPolicy:
    policy.set_score_max_age(max_age_ms)
    return policy


def _warmed(
    policy: LearnedPolicy, events, num_events: int, max_age_ms: int
) -> tuple[LearnedPolicy, np.ndarray, int]:
    """``policy`` with the refresh rule, after the first ``num_events`` events: (it,
    the hashes it tracks, the time of the last event)."""
    policy = _with_max_age(policy, max_age_ms)
    policy.observe_many(events[:num_events])
    return policy, policy.state.tracked_hashes(), events[num_events - 1].ts_ms


def _fresh(policy: LearnedPolicy, hashes: np.ndarray, now_ms: int) -> np.ndarray:
    return policy.predict_features(policy.state.features_for(hashes, now_ms))


def test_stored_scores_equal_fresh_scores_within_the_refresh_rule(
    ready_policy, contract_events
) -> None:
    policy, hashes, last_ms = _warmed(ready_policy("lightgbm"), contract_events, 300, 10_000)
    t = last_ms + 1_000
    first = policy.score(hashes, t)
    np.testing.assert_array_equal(first, _fresh(policy, hashes, t))
    # Stored now: the same call later within the age returns exactly the stored value.
    probe = copy.deepcopy(policy)
    probe.predict_features = None  # type: ignore[method-assign]  # must not be called
    np.testing.assert_array_equal(probe.score(hashes, t + 5_000), first)

    # An access voids the accessed blocks' scores: they are recomputed at that time,
    # the others are read back as stored.
    event = contract_events[300]
    t2 = t + 1  # within the age of the first scores
    policy.observe(dataclasses.replace(event, ts_ms=t2))
    second = policy.score(hashes, t2 + 1)
    accessed = np.isin(hashes, np.array(event.block_hashes, dtype=np.uint64))
    fresh = _fresh(policy, hashes, t2 + 1)
    np.testing.assert_array_equal(second[accessed], fresh[accessed])
    np.testing.assert_array_equal(second[~accessed], first[~accessed])

    # Older than the age: every score is recomputed, equal to a fresh one.
    late = t + 20_000
    np.testing.assert_array_equal(policy.score(hashes, late), _fresh(policy, hashes, late))


def test_max_age_zero_always_recomputes(ready_policy, contract_events) -> None:
    policy, hashes, t = _warmed(ready_policy("lightgbm"), contract_events, 200, 0)
    policy.score(hashes, t)
    later = t + 60_000
    np.testing.assert_array_equal(policy.score(hashes, later), _fresh(policy, hashes, later))


def test_lstm_scores_do_not_depend_on_the_batch_they_are_padded_into(
    ready_policy, contract_events
) -> None:
    policy = ready_policy("lstm")
    policy.observe_many(contract_events[:200])
    hashes = policy.state.tracked_hashes()[:100]
    t = contract_events[199].ts_ms
    rows = policy.state.features_for(hashes, t)
    whole = policy.predict_features(rows)  # padded to 128 rows
    for n in (1, 3, 17):  # padded to 16, 16, 32 rows
        np.testing.assert_allclose(policy.predict_features(rows[:n]), whole[:n], atol=1e-6)


def test_a_policy_adopting_the_state_does_not_read_the_outgoing_models_scores(
    ready_policy, contract_events
) -> None:
    outgoing, hashes, last_ms = _warmed(ready_policy("lightgbm"), contract_events, 200, 10_000)
    t = last_ms + 1
    outgoing.score(hashes, t)  # stored in the shared state
    incoming = _with_max_age(outgoing.fresh_copy(), 10_000)
    rows: list[int] = []
    predict = incoming.predict_features

    def counting(features: np.ndarray) -> np.ndarray:
        rows.append(len(features))
        return predict(features)

    incoming.predict_features = counting  # type: ignore[method-assign]
    assert incoming.adopt_state(outgoing.handover_state())
    incoming.score(hashes, t + 1)
    assert rows == [len(hashes)]
