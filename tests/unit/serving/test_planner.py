from __future__ import annotations

import numpy as np
import pytest

from serving.placement import NOWHERE, Placement
from serving.planner import Planner, PlannerParams


def table_scores(table: dict[int, float]):
    """A scorer backed by a dict: unknown blocks score 0."""

    def score(blocks: np.ndarray, now_ms: int) -> np.ndarray:
        return np.array([table.get(int(b), 0.0) for b in blocks], dtype=np.float32)

    return score


def test_placement_add_remove_sample():
    p = Placement(["hbm", "dram"], [3, 5])
    for b in (1, 2, 3):
        p.add(b, 0)
    p.add(4, 1)
    assert p.count(0) == 3 and p.tier_of(4) == 1 and p.tier_of(9) == NOWHERE
    assert p.remove(2) == 0 and p.remove(2) == NOWHERE
    assert sorted(p.members(0)) == [1, 3]
    p.move(4, 0)
    assert sorted(p.sample(0, 10, np.random.default_rng(0))) == [1, 3, 4]
    assert p.sample(0, 10, np.random.default_rng(0), exclude={1}) != []
    with pytest.raises(ValueError, match="already in tier hbm"):
        p.add(1, 1)


def test_request_blocks_are_stored_and_lowest_scores_leave_first():
    # Sample covers the whole tier, so eviction is exact: the lowest scores go.
    planner = Planner(PlannerParams(eviction_sample=64, admission=False))
    p = Placement(["hbm"], [4])
    scores = {1: 0.9, 2: 0.1, 3: 0.5, 4: 0.3}
    planner.on_request(p, [1, 2, 3, 4], table_scores(scores), 0)
    assert p.count(0) == 4
    scores.update({5: 0.8, 6: 0.7})
    moves = planner.on_request(p, [5, 6], table_scores(scores), 1)
    evicted = [m.block for m in moves if m.kind == "evict"]
    assert evicted == [2, 4]  # the exact eviction order: 0.1 then 0.3
    assert sorted(p.members(0)) == [1, 3, 5, 6]
    assert all(m.to_tier == NOWHERE for m in moves if m.kind == "evict")


def test_admission_veto_does_not_keep_a_block_that_scores_lowest():
    planner = Planner(PlannerParams(eviction_sample=64, admission=True))
    p = Placement(["hbm"], [2])
    scores = {1: 0.9, 2: 0.8, 3: 0.01}
    planner.on_request(p, [1, 2], table_scores(scores), 0)
    moves = planner.on_request(p, [3], table_scores(scores), 1)
    assert [(m.block, m.kind) for m in moves] == [(3, "store"), (3, "bypass")]
    assert sorted(p.members(0)) == [1, 2]


def test_capacity_holds_when_a_request_is_larger_than_the_tier():
    planner = Planner(PlannerParams(eviction_sample=4))
    p = Placement(["hbm"], [3])
    planner.on_request(p, list(range(10)), table_scores({}), 0)
    assert p.count(0) == 3


def test_demotions_cascade_down_the_tiers_and_out_of_the_last():
    planner = Planner(PlannerParams(eviction_sample=64, admission=False))
    p = Placement(["hbm", "dram"], [2, 2])
    scores = {b: float(b) for b in range(10)}
    for b in range(6):
        planner.on_request(p, [b], table_scores(scores), b)
        assert p.count(0) <= 2 and p.count(1) <= 2
    assert sorted(p.members(0)) == [4, 5]
    assert sorted(p.members(1)) == [2, 3]  # 0 and 1 fell out of the last tier


def test_request_promotes_its_blocks_from_lower_tiers():
    planner = Planner(PlannerParams(eviction_sample=64, admission=False))
    p = Placement(["hbm", "dram"], [2, 4])
    p.add(7, 1)
    moves = planner.on_request(p, [7, 8], table_scores({7: 0.5, 8: 0.5}), 0)
    assert [(m.block, m.from_tier, m.to_tier, m.kind) for m in moves] == [
        (7, 1, 0, "demand"),
        (8, NOWHERE, 0, "store"),
    ]


@pytest.mark.parametrize(("budget", "promoted"), [(1, [3]), (2, [3, 4]), (8, [3, 4])])
def test_prefetch_promotes_candidates_that_outscore_residents_within_budget(budget, promoted):
    planner = Planner(
        PlannerParams(eviction_sample=64, prefetch_budget_blocks=budget, min_residency_ms=0)
    )
    p = Placement(["hbm", "dram"], [2, 10])
    for b in (1, 2):
        p.add(b, 0)
    for b in (3, 4, 5):
        p.add(b, 1)
    scores = {1: 0.2, 2: 0.6, 3: 0.9, 4: 0.7, 5: 0.1}
    moves = planner.prefetch(p, [3, 4, 5], table_scores(scores), 0)
    # 3 (0.9) displaces 1 (0.2), 4 (0.7) displaces 2 (0.6); 5 (0.1) beats nobody.
    assert [m.block for m in moves if m.kind == "prefetch"] == promoted
    assert [m.block for m in moves if m.kind == "demote"] == [1, 2][: len(promoted)]
    assert p.count(0) == 2


def test_hysteresis_keeps_recently_moved_blocks():
    planner = Planner(
        PlannerParams(eviction_sample=64, prefetch_budget_blocks=8, min_residency_ms=10_000)
    )
    p = Placement(["hbm", "dram"], [1, 10])
    p.add(1, 0, now_ms=0)
    p.add(2, 1, now_ms=0)
    scores = {1: 0.1, 2: 0.9}
    assert planner.prefetch(p, [2], table_scores(scores), 5_000) == []
    moves = planner.prefetch(p, [2], table_scores(scores), 20_000)
    assert [m.kind for m in moves] == ["demote", "prefetch"]
