"""The oracle: true next access, refuses to run blind."""

from __future__ import annotations

import numpy as np
import pytest

from features.events import BlocksAccessed
from predictor import make_policy
from predictor.oracle import FutureAccesses, OracleNeedsFutureError


def _req(ts_ms: int, *blocks: int) -> BlocksAccessed:
    return BlocksAccessed(
        ts_ms=ts_ms, request_id=f"r{ts_ms}", block_hashes=blocks, block_size_tokens=16
    )


# Positions: 0:1 1:2 | 2:1 | 3:3 | 4:2 5:5 | 6:1
EVENTS = [_req(0, 1, 2), _req(100, 1), _req(100, 3), _req(250, 2, 5), _req(900, 1)]


def test_next_access_is_the_first_at_or_after_the_stream_position():
    future = FutureAccesses.from_events(EVENTS)
    blocks = np.array([1, 2, 3, 5, 42], dtype=np.uint64)
    np.testing.assert_array_equal(future.next_access_ms(blocks, 0), [0, 0, 100, 250, -1])
    np.testing.assert_array_equal(future.next_access_ms(blocks, 2), [100, 250, 100, 250, -1])
    # After request 2 (position 3): block 3's access at the same ts 100 still counts.
    np.testing.assert_array_equal(future.next_access_ms(blocks, 3), [900, 250, 100, 250, -1])
    np.testing.assert_array_equal(future.next_access_ms(blocks, 4), [900, 250, -1, 250, -1])
    np.testing.assert_array_equal(future.next_access_ms(blocks, 7), [-1, -1, -1, -1, -1])
    np.testing.assert_array_equal(future.next_access_ms(blocks, 10**9), [-1, -1, -1, -1, -1])


def test_oracle_ranks_by_time_to_next_access():
    oracle = make_policy("oracle", {"horizon_ms": 100}, future=FutureAccesses.from_events(EVENTS))
    oracle.observe(EVENTS[0])
    scores = oracle.score(np.array([1, 2, 3, 42], dtype=np.uint64), 0)
    # After request 1: block 1 and 3 are due at 100 (0.5), 2 at 250 (100/350), 42 never.
    np.testing.assert_allclose(scores, [0.5, 100 / 350, 0.5, 0.0], rtol=1e-6)


def test_oracle_refuses_to_score_without_the_annotation():
    oracle = make_policy("oracle")
    assert oracle.needs_future
    with pytest.raises(OracleNeedsFutureError, match="FutureAccesses"):
        oracle.score(np.array([1], dtype=np.uint64), 0)
