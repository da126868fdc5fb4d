"""Golden eviction orders for the baselines, and LRU equal to the reference cache."""

from __future__ import annotations

import numpy as np
import pytest

from features.annotate import access_arrays
from features.events import BlocksAccessed
from features.trace_stats import lru_hits
from predictor import make_policy

A, B, C, D, E = 101, 202, 303, 404, 505
BLOCKS = np.array([A, B, C, D, E], dtype=np.uint64)


def _req(ts_ms: int, *blocks: int) -> BlocksAccessed:
    return BlocksAccessed(
        ts_ms=ts_ms, request_id=f"r{ts_ms}", block_hashes=blocks, block_size_tokens=16
    )


# r1 reads A B C, r2 reads A D (D continues A), r3 reads E (a new root).
SEQUENCE = [_req(0, A, B, C), _req(10, A, D), _req(20, E)]


def eviction_order(name: str) -> list[int]:
    """Evict lowest score first; ``argsort`` is stable, so equal scores would keep input
    order (none of the expected orders below rely on that)."""
    policy = make_policy(name)
    policy.observe_many(SEQUENCE)
    scores = policy.score(BLOCKS, 30)
    assert len(set(scores.tolist())) == len(BLOCKS), "golden orders must not depend on ties"
    return BLOCKS[np.argsort(scores, kind="stable")].tolist()


def test_lru_golden_order():
    # Accesses in order: A B C A D E -> least recent first: B C A D E.
    assert eviction_order("lru") == [B, C, A, D, E]


def test_lfu_golden_order():
    # A was read twice; the rest once, ties broken least-recent first: B C D E, then A.
    assert eviction_order("lfu") == [B, C, D, E, A]


def test_prefix_lru_golden_order():
    # Radix style: r1's blocks are oldest, leaf C before its parent B; r2's leaf D before
    # A (A was refreshed by r2); r3's E last.
    assert eviction_order("prefix_lru") == [C, B, D, A, E]


def test_unknown_block_ranks_below_every_known_one():
    for name in ("lru", "lfu", "prefix_lru"):
        policy = make_policy(name)
        policy.observe_many(SEQUENCE)
        scores = policy.score(np.array([999, A, B, C, D, E], dtype=np.uint64), 30)
        assert scores[0] < scores[1:].min(), name


def _cache_hits(name: str, events: list[BlocksAccessed], capacity: int) -> int:
    """A demand cache of ``capacity`` blocks that evicts the policy's lowest score."""
    policy = make_policy(name)
    resident: list[int] = []
    hits = 0
    for event in events:
        for block in event.block_hashes:
            if block in resident:
                hits += 1
            else:
                resident.append(block)
            policy.observe(_req(event.ts_ms, block))
            if len(resident) > capacity:
                scores = policy.score(np.array(resident, dtype=np.uint64), event.ts_ms)
                resident.pop(int(np.argmin(scores)))
    return hits


@pytest.mark.parametrize("capacity", [30, 150])
def test_lru_policy_is_exactly_the_reference_lru(capacity):
    from features.decoders import decode_mooncake
    from features.generator import generate, params_for

    rows = generate(params_for("chat", num_requests=120, seed=5))
    events = [decode_mooncake(r, str(i)) for i, r in enumerate(rows)]
    expected = lru_hits(access_arrays(events).block_ids, capacity)
    assert expected > 0
    assert _cache_hits("lru", events, capacity) == expected
