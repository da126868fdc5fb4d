"""Batched eviction (``PlannerParams.evict_ahead_visits``): a scored round queues the
victims of the next requests, which take them without a scoring call (the tier stays at
capacity); a round samples per request it stands for, and the next one reconsiders what
those requests stored."""

from __future__ import annotations

import numpy as np

from serving.placement import Placement
from serving.planner import Planner, PlannerParams


class CountingScores:
    """Scores from a fixed table (unknown blocks 0), counting calls and rows."""

    def __init__(self, table: dict[int, float]) -> None:
        self.table = table
        self.calls = 0
        self.rows = 0

    def __call__(self, blocks: np.ndarray, now_ms: int) -> np.ndarray:
        self.calls += 1
        self.rows += int(blocks.shape[0])
        return np.array([self.table.get(int(b), 0.0) for b in blocks], dtype=np.float32)


def _stream(num_requests: int, blocks_per_request: int, seed: int) -> list[list[int]]:
    """Requests of distinct blocks drawn from a Zipf-like popularity over 20,000 ids."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, 20_001) ** 0.9
    weights /= weights.sum()
    out = []
    for _ in range(num_requests):
        ids = rng.choice(20_000, size=blocks_per_request, replace=False, p=weights)
        out.append([int(b) + 1 for b in ids])
    return out


def _run(params: PlannerParams, capacity: int, requests: list[list[int]]):
    # Popular ids score high: a fixed ranking the planner should keep.
    scores = CountingScores({b: 1.0 / b for b in range(1, 20_001)})
    planner, placement = Planner(params), Placement(["hbm"], [capacity])
    hits = accesses = 0
    counts = []
    for i, blocks in enumerate(requests):
        hits += sum(placement.tier_of(b) == 0 for b in blocks)
        accesses += len(blocks)
        planner.on_request(placement, blocks, scores, i)
        assert placement.count(0) <= capacity  # the invariant holds after every request
        counts.append(placement.count(0))
    return hits / accesses, scores, counts


def test_batched_rounds_score_far_less_often_and_keep_the_hit_ratio():
    requests = _stream(1_500, 20, seed=3)
    capacity = 2_000
    per_request = PlannerParams(evict_ahead_visits=0, seed=1)
    batched = PlannerParams(evict_ahead_visits=8, evict_ahead_share=1 / 16, seed=1)
    hit_one, one, counts_one = _run(per_request, capacity, requests)
    hit_batched, many, counts = _run(batched, capacity, requests)
    # A round about every 8 requests: the queue holds 1/16 of the tier (125 blocks),
    # about 7 requests' intake of ~18 new blocks.
    assert many.calls < one.calls / 4
    # As many residents sampled per request as before: the same selectivity ...
    assert many.rows > 0.8 * one.rows
    # ... so the hit ratio stays where it was ...
    assert abs(hit_batched - hit_one) < 0.01
    # ... and so does the tier's occupancy: queued victims leave only when room is
    # needed, so once full the tier stays full.
    assert counts == counts_one
    assert counts[-1] == capacity


def test_zero_visits_is_one_round_per_overflowing_request():
    requests = _stream(400, 20, seed=4)
    _, scores, _ = _run(PlannerParams(evict_ahead_visits=0), 500, requests)
    planner, placement = Planner(PlannerParams(evict_ahead_visits=0)), Placement(["hbm"], [500])
    overflowing = 0
    for i, blocks in enumerate(requests):
        before = placement.count(0) + sum(placement.tier_of(b) != 0 for b in blocks)
        overflowing += before > 500
        planner.on_request(placement, blocks, CountingScores(scores.table), i)
    assert scores.calls == overflowing


def test_a_one_off_block_stored_between_rounds_is_the_next_round_s_first_victim():
    # Tier of 256: a round queues 8 victims ahead (1/32), so the next one-block requests
    # take them without a scoring call; block 999 scores lowest of all and must not
    # survive the next round, although no round ran when it was stored (deferred
    # admission).
    table = {b: 1.0 + b / 1000 for b in range(1, 400)}
    table[999] = 0.0
    scores = CountingScores(table)
    params = PlannerParams(eviction_sample=4, evict_ahead_visits=8, evict_ahead_share=1 / 32)
    planner, placement = Planner(params), Placement(["hbm"], [256])
    planner.on_request(placement, list(range(1, 257)), scores, 0)  # full
    for block in (300, 301, 302):  # the intake settles at one block a request
        planner.on_request(placement, [block], scores, block)
    calls = scores.calls
    planner.on_request(placement, [999], scores, 2)  # a queued victim makes its room
    assert scores.calls == calls and placement.tier_of(999) == 0
    assert placement.count(0) == 256
    block = 303
    while scores.calls == calls:  # one-block requests until the next round
        planner.on_request(placement, [block], scores, block)
        block += 1
    assert placement.tier_of(999) != 0


def test_a_queued_victim_read_since_its_round_stays():
    # Blocks 1..256 score by id: a round queues the lowest ids after its victims. One
    # of them is read before its turn: its queued score is stale, so it is skipped.
    scores = CountingScores({b: float(b) for b in range(1, 1000)})
    params = PlannerParams(
        eviction_sample=256, evict_ahead_visits=8, evict_ahead_share=1 / 16, seed=2
    )
    planner, placement = Planner(params), Placement(["hbm"], [256])
    planner.on_request(placement, list(range(1, 257)), scores, 0)
    for block in (500, 501, 502):  # rounds until the intake settles at one a request
        planner.on_request(placement, [block], scores, block)
    queued = list(reversed(planner._queue[0]))  # next victims, first to go first
    assert len(queued) >= 4
    calls = scores.calls
    planner.on_request(placement, [queued[0]], scores, 600)  # read: a hit, no eviction
    for block in (601, 602, 603):
        planner.on_request(placement, [block], scores, block)
    assert scores.calls == calls  # taken from the queue
    assert placement.tier_of(queued[0]) == 0  # read since: skipped
    assert all(placement.tier_of(b) != 0 for b in queued[1:4])
