"""A learned policy's chain tracker is part of the checkpointed state (issue 12): captured
as plain data and arrays, restored into a fresh policy of the same model, it offers the
same prefetch candidates afterwards, and keeps doing so as both see more requests."""

from __future__ import annotations

import numpy as np
import pytest

from features.decoders import decode_mooncake
from features.generator import generate, params_for
from predictor.learned import LearnedPolicy
from serving.checkpoint import (
    CheckpointMismatchError,
    capture,
    check_checkpointable,
    fresh_policy,
    restore,
)
from serving.model_lifecycle import ScoringFallback
from serving.state_store import decode_state, encode_state

HORIZON_MS = 10_000


def _events(num: int, seed: int):
    rows = generate(params_for("planted", num_requests=num, seed=seed))
    return [decode_mooncake(row, str(i)) for i, row in enumerate(rows)]


@pytest.fixture(scope="module")
def model() -> LearnedPolicy:
    from training.train import fit_policy_on_events

    events = _events(1_500, seed=1)
    policy = fit_policy_on_events("lightgbm", events[:900], quick=True, horizon_ms=HORIZON_MS)
    assert policy.chain is not None
    return policy


@pytest.fixture(scope="module")
def stream():
    events = _events(1_200, seed=7)
    return events[:700], events[700:]


def _through_the_store(tree):
    """What a snapshot goes through: encoded to bytes (plain data and arrays only)."""
    return decode_state(encode_state(tree))


def test_restored_chain_tracker_gives_the_same_prefetch_candidates(model, stream):
    before, after = stream
    live = model.fresh_copy()
    live.observe_many(before)
    now_ms = before[-1].ts_ms + 1
    expected = live.prefetch_candidates(now_ms, 512)
    assert expected.shape[0] > 0
    tree = _through_the_store(capture(live, copy=True))
    restored = fresh_policy(live)
    assert not restored.chain.tracker.chains
    restore(restored, tree)
    assert list(restored.chain.tracker.chains) == list(live.chain.tracker.chains)
    assert restored.chain.tracker.anchors == live.chain.tracker.anchors
    assert restored.chain.tracker.root_requests == live.chain.tracker.root_requests
    assert np.array_equal(restored.prefetch_candidates(now_ms, 512), expected)
    # Everything a later decision depends on came back: both go on identically.
    for i, event in enumerate(after):
        live.observe(event)
        restored.observe(event)
        if i % 100 == 99:
            now_ms = event.ts_ms + 1
            assert np.array_equal(
                restored.prefetch_candidates(now_ms, 512), live.prefetch_candidates(now_ms, 512)
            )
    assert restored.chain.tracker.chains == live.chain.tracker.chains


def test_a_wrapped_learned_policy_with_a_chain_is_checkpointable(model, stream):
    before, _ = stream
    wrapped = ScoringFallback(model.fresh_copy(), lambda guard, why: guard.inner)
    check_checkpointable(wrapped)
    wrapped.observe_many(before)
    tree = _through_the_store(capture(wrapped, copy=True))
    again = fresh_policy(wrapped)
    restore(again, tree)
    now_ms = before[-1].ts_ms + 1
    assert np.array_equal(
        again.prefetch_candidates(now_ms, 256), wrapped.prefetch_candidates(now_ms, 256)
    )


def test_a_snapshot_without_a_chain_keeps_the_loaded_chain_model(model, stream):
    before, _ = stream
    plain = model.fresh_copy()
    plain.chain = None
    plain.observe_many(before)
    tree = _through_the_store(capture(plain, copy=True))
    with_chain = model.fresh_copy()
    restore(with_chain, tree)
    assert with_chain.chain is not None and with_chain.chain.booster is model.chain.booster
    assert not with_chain.chain.tracker.chains and not with_chain.chain.tracker.index_blocks
    with_chain.observe_many(before[-50:])
    assert with_chain.prefetch_candidates(before[-1].ts_ms + 1, 64).shape[0] > 0


def test_a_snapshot_with_a_chain_does_not_fit_a_policy_without_one(model, stream):
    before, _ = stream
    live = model.fresh_copy()
    live.observe_many(before[:100])
    tree = _through_the_store(capture(live, copy=True))
    plain = model.fresh_copy()
    plain.chain = None
    with pytest.raises(CheckpointMismatchError):
        restore(plain, tree)


def test_a_damaged_chain_table_is_refused(model, stream):
    before, _ = stream
    live = model.fresh_copy()
    live.observe_many(before[:200])
    tree = _through_the_store(capture(live, copy=True))
    table = tree["chain_tracker"]["v"]["chain_table"]
    column = table["k"].index("length")
    table["v"][column] = table["v"][column] + 1
    with pytest.raises(ValueError, match="lengths"):
        restore(model.fresh_copy(), tree)
