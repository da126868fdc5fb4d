"""The contract every registered policy keeps (one suite, run over all of them)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from features.events import BlocksAccessed
from predictor import Policy, available_policies, load_policy

NAMES = available_policies()


def _probe(events: list[BlocksAccessed]) -> tuple[np.ndarray, int]:
    """Seen blocks in a scrambled order, two never-seen hashes, and a time after the
    last event."""
    seen = np.unique(np.fromiter((h for e in events for h in e.block_hashes), dtype=np.uint64))
    rng = np.random.default_rng(0)
    picked = rng.permutation(seen)[:200]
    unknown = np.array([2**64 - 1, 2**63 + 12345], dtype=np.uint64)
    return np.concatenate([picked[:100], unknown, picked[100:]]), events[-1].ts_ms + 1


def _fed(build: Callable[[str], Policy], name: str, events: list[BlocksAccessed]) -> Policy:
    policy = build(name)
    policy.observe_many(events[:-50])
    for event in events[-50:]:
        policy.observe(event)
    return policy


@pytest.mark.parametrize("name", NAMES)
def test_scores_have_input_length_order_and_dtype(name, ready_policy, contract_events):
    policy = _fed(ready_policy, name, contract_events)
    blocks, now_ms = _probe(contract_events)
    scores = policy.score(blocks, now_ms)
    assert scores.dtype == np.float32
    assert scores.shape == blocks.shape
    assert np.all(np.isfinite(scores))
    # Order: scoring a permutation permutes the scores. (Batched float kernels may
    # differ in the last bit with a row's position in the batch, hence the tolerance.)
    perm = np.random.default_rng(1).permutation(blocks.shape[0])
    np.testing.assert_allclose(
        policy.score(blocks[perm], now_ms), scores[perm], rtol=1e-5, atol=1e-7
    )
    # One at a time gives the same as the batch.
    singles = np.concatenate([policy.score(blocks[i : i + 1], now_ms) for i in range(5)])
    np.testing.assert_allclose(singles, scores[:5], rtol=1e-5, atol=1e-7)
    assert policy.score(np.zeros(0, dtype=np.uint64), now_ms).shape == (0,)


@pytest.mark.parametrize("name", NAMES)
def test_observe_and_score_do_not_mutate_inputs(name, ready_policy, contract_events):
    events = list(contract_events)
    before = copy.deepcopy(events)
    policy = _fed(ready_policy, name, events)
    assert events == before
    blocks, now_ms = _probe(contract_events)
    kept = blocks.copy()
    policy.score(blocks, now_ms)
    np.testing.assert_array_equal(blocks, kept)


@pytest.mark.parametrize("name", NAMES)
def test_seeded_runs_repeat_exactly(name, ready_policy, contract_events):
    blocks, now_ms = _probe(contract_events)
    first = _fed(ready_policy, name, contract_events).score(blocks, now_ms)
    second = _fed(ready_policy, name, contract_events).score(blocks, now_ms)
    np.testing.assert_array_equal(first, second)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_blocks_get_a_score(name, ready_policy, contract_events):
    policy = ready_policy(name)
    # Before any event, and after: never an exception, always a finite float.
    unknown = np.array([7, 2**64 - 2], dtype=np.uint64)
    assert np.all(np.isfinite(policy.score(unknown, 0)))
    policy.observe_many(contract_events[:20])
    assert np.all(np.isfinite(policy.score(unknown, contract_events[19].ts_ms)))


@pytest.mark.parametrize("name", NAMES)
def test_save_load_round_trip_scores_identically(
    name, ready_policy, contract_events, tmp_path: Path
):
    policy = _fed(ready_policy, name, contract_events)
    blocks, now_ms = _probe(contract_events)
    policy.save(tmp_path / name)
    kwargs = {"future": policy.future} if policy.needs_future else {}
    loaded = load_policy(tmp_path / name, **kwargs)
    assert type(loaded) is type(policy)
    assert loaded.params == policy.params
    loaded.observe_many(contract_events)
    np.testing.assert_array_equal(loaded.score(blocks, now_ms), policy.score(blocks, now_ms))


@pytest.mark.parametrize("name", NAMES)
def test_residency_events_are_accepted(name, ready_policy, contract_events):
    from features.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier

    policy = _fed(ready_policy, name, contract_events[:100])
    ts = contract_events[99].ts_ms
    policy.observe(BlockStored(ts, (1, 2), None, 16, Tier.DRAM, 32))
    policy.observe(BlockRemoved(ts, (1,), Tier.DRAM))
    policy.observe(AllBlocksCleared(ts))
    assert policy.score(np.array([1, 2], dtype=np.uint64), ts).shape == (2,)
