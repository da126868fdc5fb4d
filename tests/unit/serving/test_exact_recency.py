"""Exact recency eviction: a policy that ranks by recency (LRU, or the guard while it
serves LRU) is served as exact LRU, not as the sampled approximation.

The reference here is written independently of the planner: an ``OrderedDict`` cache
that, per request, counts the blocks it holds at arrival, then marks the request's
blocks most recent in prefix order and drops the oldest past capacity."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from features.events import BlocksAccessed
from predictor.baselines import LFUPolicy, LRUPolicy
from predictor.guard import GuardedPolicy, GuardParams
from serving.checkpoint import capture, restore
from serving.placement import Placement
from serving.planner import Planner, PlannerParams
from serving.state_store import decode_state, encode_state
from training.replay import replay_single_tier


def request_lru_hits(
    events: list[BlocksAccessed], capacity: int, cache: OrderedDict[int, None] | None = None
) -> int:
    """Hits of request-granular exact LRU; ``cache`` (when given) ends holding its
    contents, oldest first."""
    cache = OrderedDict() if cache is None else cache
    hits = 0
    for event in events:
        hits += sum(1 for b in event.block_hashes if b in cache)
        for b in dict.fromkeys(event.block_hashes):
            cache[b] = None
            cache.move_to_end(b)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def reuse_events(num_requests: int = 1_500, seed: int = 3) -> list[BlocksAccessed]:
    """Chains that grow and come back after random gaps, with shared prefixes and some
    requests larger than the smallest cache tried."""
    rng = np.random.default_rng(seed)
    chains: list[list[int]] = []
    next_block = 1
    events = []
    for i in range(num_requests):
        if chains and rng.random() < 0.7:
            chain = chains[int(rng.integers(max(0, len(chains) - 40), len(chains)))]
        else:
            chain = [] if not chains or rng.random() < 0.5 else list(chains[0][:4])
            chains.append(chain)
        grow = int(rng.integers(1, 60 if rng.random() < 0.05 else 6))
        chain += range(next_block, next_block + grow)
        next_block += grow
        events.append(
            BlocksAccessed(
                ts_ms=100 * i, request_id=str(i), block_hashes=tuple(chain), block_size_tokens=16
            )
        )
    return events


@pytest.mark.parametrize("capacity", [7, 50, 400, 3_000])
def test_lru_through_the_planner_is_exact_lru(capacity):
    events = reuse_events()
    reference = request_lru_hits(events, capacity)
    exact = replay_single_tier(LRUPolicy(), events, capacity)
    assert exact.hits == reference
    sampled = replay_single_tier(
        LRUPolicy(), events, capacity, planner_params=PlannerParams(exact_recency=False)
    )
    if capacity in (50, 400):  # the tiers where a 64-block sample misses the oldest
        assert sampled.hits != reference


def test_a_guard_serving_lru_is_exact_lru_and_its_lru_ghost_is_exact():
    events = reuse_events()
    capacity = 400
    # It never leaves LRU here: no switch before 10**9 sampled accesses.
    guard = GuardedPolicy(
        GuardParams(capacity_blocks=capacity, ghost_blocks=capacity, min_sampled_accesses=10**9),
        {"lru": LRUPolicy(), "lfu": LFUPolicy()},
    )
    assert guard.rate == 1.0 and guard.chosen == "lru" and guard.ranks_by_recency
    result = replay_single_tier(guard, events, capacity)
    cache: OrderedDict[int, None] = OrderedDict()
    assert result.hits == request_lru_hits(events, capacity, cache)
    # Every block is sampled (rate 1), so the LRU ghost is that same cache, in order.
    assert list(guard.ghosts["lru"].order) == list(cache)


def test_the_guard_ranks_by_recency_only_while_it_serves_lru():
    guard = GuardedPolicy(
        GuardParams(capacity_blocks=100, initial="lfu"), {"lru": LRUPolicy(), "lfu": LFUPolicy()}
    )
    assert not guard.ranks_by_recency
    guard.chosen = "lru"
    assert guard.ranks_by_recency


def test_each_tier_keeps_its_residents_in_touch_order_through_moves():
    planner = Planner(PlannerParams(seed=0))
    p = Placement(["hbm", "dram", "nvme"], [20, 60, 500])
    events = reuse_events(400)
    lru = LRUPolicy()
    for event in events:
        lru.observe(event)
        planner.on_request(p, list(dict.fromkeys(event.block_hashes)), lru.score, event.ts_ms, True)
        for t in range(p.num_tiers):
            assert sorted(p.order(t)) == sorted(p.members(t))
    # The fastest tier holds exactly the most recently read distinct blocks ...
    recent: list[int] = []
    for event in reversed(events):
        for b in reversed(event.block_hashes):
            if b not in recent:
                recent.append(b)
    assert set(p.order(0)) == set(recent[:20])
    # ... oldest first, and the tier below holds the next ones down, in order too.
    assert list(p.order(0)) == recent[:20][::-1]
    assert list(p.order(1)) == recent[20:80][::-1]


def test_the_touch_order_survives_a_checkpoint():
    p = Placement(["hbm", "dram"], [30, 100])
    planner = Planner()
    lru = LRUPolicy()
    for event in reuse_events(300):
        lru.observe(event)
        planner.on_request(p, list(dict.fromkeys(event.block_hashes)), lru.score, event.ts_ms, True)
    fresh = Placement(["hbm", "dram"], [30, 100])
    restore(fresh, decode_state(encode_state(capture(p))))
    for t in range(2):
        assert list(fresh.order(t)) == list(p.order(t))
        assert fresh.members(t) == p.members(t)
    fresh.order(0).move_to_end(next(iter(fresh.order(0))))  # still an OrderedDict
