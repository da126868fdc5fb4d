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


@pytest.mark.parametrize(
    "name, expected",
    # X read 1st and 5th, Y 2nd and 3rd, Z 4th: Z (read once) first, then the
    # twice-read: LRU-2 by their second-to-last read, X (1st) before Y (2nd); second-hit
    # LRU by their last, Y (3rd) before X (5th). LRU would give Y Z X and LFU Z Y X.
    [("lru2", "zxy"), ("lru_2hit", "zyx")],
)
def test_twice_read_golden_orders(name, expected):
    ids = {"x": 11, "y": 22, "z": 33}
    x, y, z = ids.values()
    policy = make_policy(name)
    policy.observe_many([_req(0, x), _req(1, y), _req(2, y), _req(3, z), _req(4, x)])
    blocks = np.array([x, y, z], dtype=np.uint64)
    order = blocks[np.argsort(policy.score(blocks, 5), kind="stable")].tolist()
    assert order == [ids[c] for c in expected]


def test_unknown_block_ranks_below_every_known_one():
    for name in ("lru", "lfu", "lru2", "lru_2hit", "prefix_lru"):
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


def _agent_events() -> list[BlocksAccessed]:
    """120 requests of the agent profile, where reads repeat behind one-off ones."""
    from features.decoders import decode_mooncake
    from features.generator import generate, params_for

    rows = generate(params_for("agent", num_requests=120, seed=5))
    return [decode_mooncake(r, str(i)) for i, r in enumerate(rows)]


def _second_to_last_read(history: list[int]) -> tuple[int, int]:
    """LRU-2's eviction key: the second-to-last read; read once: first, by the read."""
    return (1, history[-2]) if len(history) >= 2 else (0, history[-1])


def _last_read_if_twice(history: list[int]) -> tuple[int, int]:
    """Second-hit LRU's: the last read; read once: first, by the read."""
    return (1 if len(history) >= 2 else 0, history[-1])


def _reference_hits(events: list[BlocksAccessed], capacity: int, rank=_second_to_last_read) -> int:
    """A cache written from the policy's definition: evict the resident whose ``rank``
    of its read history is lowest (for LRU-2: the second-to-last read oldest; residents
    read once go first, least recently read first)."""
    reads: dict[int, list[int]] = {}
    resident: set[int] = set()
    hits = clock = 0
    for event in events:
        for block in event.block_hashes:
            clock += 1
            hits += block in resident
            resident.add(block)
            reads.setdefault(block, []).append(clock)
            if len(resident) > capacity:
                resident.remove(min(resident, key=lambda b: rank(reads[b])))
    return hits


@pytest.mark.parametrize("capacity", [30, 150])
def test_lru2_policy_is_exactly_the_reference_lru2(capacity):
    events = _agent_events()
    expected = _reference_hits(events, capacity)
    assert expected > 0
    assert _cache_hits("lru2", events, capacity) == expected
    assert expected != lru_hits(access_arrays(events).block_ids, capacity)


@pytest.mark.parametrize("capacity", [30, 150])
def test_lru_2hit_policy_is_exactly_the_reference_second_hit_lru(capacity):
    events = _agent_events()
    expected = _reference_hits(events, capacity, _last_read_if_twice)
    assert expected > 0
    assert _cache_hits("lru_2hit", events, capacity) == expected
    assert expected != lru_hits(access_arrays(events).block_ids, capacity)
    assert expected != _reference_hits(events, capacity)  # not LRU-2 either
