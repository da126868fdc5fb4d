"""Batched eviction (``PlannerParams.evict_ahead_visits``): a scored round queues the
victims of the next requests, which take them without a round (the tier stays at
capacity); a round samples per request it stands for, and what those requests store
faces the admission veto against the queued victims at once, scored alone."""

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
        self.sizes: list[int] = []

    def __call__(self, blocks: np.ndarray, now_ms: int) -> np.ndarray:
        self.calls += 1
        self.rows += int(blocks.shape[0])
        self.sizes.append(int(blocks.shape[0]))
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


def test_batched_rounds_sample_far_less_often_and_keep_the_hit_ratio():
    requests = _stream(1_500, 20, seed=3)
    capacity = 2_000
    per_request = PlannerParams(evict_ahead_visits=0, seed=1)
    batched = PlannerParams(evict_ahead_visits=8, evict_ahead_share=1 / 16, seed=1)
    hit_one, one, counts_one = _run(per_request, capacity, requests)
    hit_batched, many, counts = _run(batched, capacity, requests)
    # A round (a sample of residents: more rows than one request's 20 blocks) about
    # every 8 requests: the queue holds 1/16 of the tier (125 blocks), about 7
    # requests' intake of ~18 new blocks. In between, a call scores only what the
    # request stored (the veto against the queued victims).
    rounds = [n for n in many.sizes if n > 20]
    params_sample = batched.eviction_sample
    assert len(rounds) < one.calls / 4
    assert len(rounds) + sum(n <= 20 for n in many.sizes) == many.calls
    # A round samples eviction_sample residents per request its queue stands for, so
    # victims are chosen as selectively; a stored block the veto sends down at once
    # takes no queued victim, so a queue can outlast its 8 requests (never 4x) ...
    assert all(n >= 8 * params_sample for n in rounds)
    # ... and the hit ratio stays where it was ...
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


def test_a_one_off_block_stored_between_rounds_is_vetoed_at_once():
    # Tier of 256: a round queues 8 victims ahead (1/32), so the next one-block requests
    # take them without a round. Block 999 scores lowest of all: scored alone against
    # the queued victim it would displace, it is sent down at once (a bypass), and the
    # victim stays queued for the next request.
    table = {b: 1.0 + b / 1000 for b in range(1, 400)}
    table[999] = 0.0
    scores = CountingScores(table)
    params = PlannerParams(eviction_sample=4, evict_ahead_visits=8, evict_ahead_share=1 / 32)
    planner, placement = Planner(params), Placement(["hbm", "dram"], [256, 1024])
    planner.on_request(placement, list(range(1, 257)), scores, 0)  # full
    for block in (300, 301, 302):  # the intake settles at one block a request
        planner.on_request(placement, [block], scores, block)
    queued = list(reversed(planner._queue[0]))
    calls = scores.calls
    moves = planner.on_request(placement, [999], scores, 2)
    assert scores.sizes[calls:] == [1]  # the stored block alone, no round
    assert placement.tier_of(999) == 1 and placement.count(0) == 256
    assert [(m.block, m.kind) for m in moves if m.kind != "store"] == [(999, "bypass")]
    assert list(reversed(planner._queue[0])) == queued  # nothing taken off the queue
    # A block that outscores the queued victim takes its room, with one call again.
    moves = planner.on_request(placement, [350], scores, 3)
    assert scores.sizes[calls + 1 :] == [1]
    assert placement.tier_of(350) == 0
    assert [(m.block, m.kind) for m in moves if m.kind != "store"] == [(queued[0], "demote")]


def test_blocks_demoted_from_above_are_vetoed_below_with_the_scores_they_came_with():
    # Two tiers, both batched: what the fastest tier demotes is stored into the next,
    # and its veto there reuses the scores the demotion was decided with (no call).
    scores = CountingScores({b: float(b) for b in range(1, 5_000)})
    params = PlannerParams(eviction_sample=8, evict_ahead_visits=8, evict_ahead_share=1 / 8)
    planner, placement = Planner(params), Placement(["hbm", "dram"], [64, 64])
    for i in range(40):
        planner.on_request(placement, [1000 + 4 * i + k for k in range(4)], scores, i)
    assert planner._queue.get(1)  # the lower tier has a queue of its own
    calls = scores.calls
    moves = planner.on_request(placement, [2000, 2001, 2002, 2003], scores, 50)
    # One call at most: the stored blocks' veto in the fastest tier (or its round).
    assert scores.calls - calls <= 1
    assert all(placement.count(t) <= 64 for t in (0, 1))
    demoted = [m for m in moves if m.from_tier == 0 and m.to_tier == 1]
    evicted = [m for m in moves if m.from_tier == 1]
    assert demoted and evicted
    # The veto below: what the fastest tier sent down and the lower tier kept scores
    # at least as high as everything the lower tier let go for it.
    kept = [m.score for m in demoted if placement.tier_of(m.block) == 1]
    assert kept and min(kept) >= max(m.score for m in evicted)


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
    assert scores.sizes[calls:] == [1, 1, 1]  # taken from the queue: no round, only
    # each stored block's veto against the victim it displaces
    assert placement.tier_of(queued[0]) == 0  # read since: skipped
    assert all(placement.tier_of(b) != 0 for b in queued[1:4])
