"""Baselines track at most ``max_tracked_blocks`` blocks, forgetting the oldest first."""

from __future__ import annotations

import numpy as np
import pytest

from features.events import BlocksAccessed
from predictor.registry import make_policy


def _events(num: int, seed: int = 0) -> list[BlocksAccessed]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        root = int(rng.integers(0, 300))
        length = int(rng.integers(1, 6))
        hashes = tuple(root * 100 + j for j in range(length))
        out.append(
            BlocksAccessed(ts_ms=i, request_id=str(i), block_hashes=hashes, block_size_tokens=16)
        )
    return out


@pytest.mark.parametrize("name", ["lru", "lfu", "prefix_lru"])
def test_the_table_never_holds_more_than_the_cap(name):
    policy = make_policy(name, {"max_tracked_blocks": 64})
    distinct = set()
    for event in _events(2000):
        policy.observe(event)
        distinct.update(event.block_hashes)
        assert len(policy._table.slot_of) <= 64
    assert len(distinct) > 500 and policy._table.num_forgotten > 0
    assert policy._table.last_access.shape[0] <= 64


def test_capped_lru_ranks_every_tracked_block_as_exact_lru_does():
    capped = make_policy("lru", {"max_tracked_blocks": 128})
    exact = make_policy("lru")
    events = _events(3000, seed=1)
    for event in events:
        capped.observe(event)
        exact.observe(event)
    blocks = np.array(sorted({b for e in events for b in e.block_hashes}), dtype=np.uint64)
    tracked = np.array([b in capped._table.slot_of for b in blocks.tolist()])
    assert 0 < tracked.sum() <= 128
    s_capped = capped.score(blocks, 0)
    s_exact = exact.score(blocks, 0)
    np.testing.assert_array_equal(s_capped[tracked], s_exact[tracked])
    # Forgotten blocks sit at the floor, below every tracked block, as they did in LRU.
    assert s_capped[~tracked].max() < s_capped[tracked].min()
    assert s_exact[~tracked].max() < s_exact[tracked].min()


def test_the_cap_is_a_validated_param():
    with pytest.raises(ValueError):
        make_policy("lru", {"max_tracked_blocks": 0})


@pytest.mark.parametrize("keep_previous", [False, True])
@pytest.mark.parametrize("max_blocks", [64, 1_000])
def test_bulk_update_equals_the_per_block_loop(keep_previous, max_blocks):
    """Requests of >= 8 distinct blocks update the table in array operations; the result
    is the per-block loop's exactly, duplicates, growth and forgetting included."""
    from predictor.baselines import _BlockTable

    rng = np.random.default_rng(5)
    bulk = _BlockTable(initial_capacity=16, max_blocks=max_blocks, keep_previous=keep_previous)
    loop = _BlockTable(initial_capacity=16, max_blocks=max_blocks, keep_previous=keep_previous)
    for i in range(400):
        size = int(rng.integers(1, 40))
        ids = rng.choice(300, size=size, replace=False).tolist()
        if i % 7 == 0:
            ids[-1] = ids[0]  # a block read twice in one request
        hashes = tuple(b * 0x9E3779B97F4A7C15 % (1 << 64) for b in ids)  # above 2**63 too
        event = BlocksAccessed(
            ts_ms=i, request_id=str(i), block_hashes=hashes, block_size_tokens=16
        )
        bulk.observe(event)
        loop._observe_loop(event.block_hashes)
    assert bulk.slot_of == loop.slot_of
    assert bulk.num_accesses == loop.num_accesses and bulk.num_requests == loop.num_requests
    assert bulk.free_slots == loop.free_slots and bulk.num_forgotten == loop.num_forgotten
    for name in bulk._arrays:
        assert np.array_equal(getattr(bulk, name), getattr(loop, name)), name
    assert bulk.num_forgotten > 0 or max_blocks > 300  # the small table did forget
