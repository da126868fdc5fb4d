"""Golden values of every feature on a tiny hand-built trace, worked out by hand.

Trace (block ids in prefix order):

    r0  t=0     [1, 2, 3]        input 1500 output 100   (turn 1: nothing known)
    r1  t=1000  [1, 2, 4, 5]     input 2000 output 200   (hit tail 2 was 1 from r0's tail -> turn 2)
        t=1500  residency: 2 stored in DRAM, stored in HBM, removed from HBM
    r2  t=4000  [1, 2, 4, 5, 6]  input 2500 output 300   (hit tail 5 was r1's tail -> turn 3)

Queried at now = 10_000 ms.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from features.events import BlockRemoved, BlocksAccessed, BlockStored, Tier
from features.feature_set import FEATURE_NAMES, MISSING
from features.state import FeatureParams, FeatureState

NOW = 10_000


def _events() -> list[object]:
    return [
        BlocksAccessed(0, "r0", (1, 2, 3), 512, 1500, 100),
        BlocksAccessed(1000, "r1", (1, 2, 4, 5), 512, 2000, 200),
        BlockStored(1500, (2,), None, 512, Tier.DRAM),
        BlockStored(1500, (2,), None, 512, Tier.HBM),
        BlockRemoved(1500, (2,), Tier.HBM),
        BlocksAccessed(4000, "r2", (1, 2, 4, 5, 6), 512, 2500, 300),
    ]


def _decayed(times: list[int], half_life_s: float, now: int = NOW) -> float:
    return sum(2.0 ** (-(now - t) / (half_life_s * 1000.0)) for t in times)


def _rate(weights_times: list[tuple[int, int]], half_life_s: float) -> float:
    """Decayed count of ``weight`` events at each time, as a per-second rate."""
    count = sum(w * 2.0 ** (-(NOW - t) / (half_life_s * 1000.0)) for w, t in weights_times)
    return count * math.log(2) / half_life_s


REQUESTS = [(1, 0), (1, 1000), (1, 4000)]
BLOCKS = [(3, 0), (4, 1000), (5, 4000)]
ROOT_DECAYED = _decayed([0, 1000, 4000], 60.0)

EXPECTED: dict[int, dict[str, float]] = {
    2: {
        "known": 1,
        "gap_1_ms": 3000,
        "gap_2_ms": 1000,
        "decayed_count_hl_10s": _decayed([0, 1000, 4000], 10),
        "decayed_count_hl_60s": _decayed([0, 1000, 4000], 60),
        "decayed_count_hl_600s": _decayed([0, 1000, 4000], 600),
        "decayed_count_hl_3600s": _decayed([0, 1000, 4000], 3600),
        "access_count": 3,
        "age_ms": 10_000,
        "time_since_last_access_ms": 6000,
        "requests_since_last_access": 0,
        "depth": 1,
        "last_request_num_blocks": 5,
        "blocks_to_tail": 3,
        "ever_tail": 0,
        "last_request_input_tokens": 2500,
        "last_request_output_tokens": 300,
        "last_request_hit_fraction": 4 / 5,
        "turn_index": 3,
        "turn_gap_ms": 3000,  # r2 (4000) continued r1 (1000)
        "num_children": 2,  # 3 (r0) and 4 (r1)
        "time_since_child_access_ms": 6000,
        "time_since_extended_ms": 6000,  # r2 appended 6
        "parent_time_since_last_access_ms": 6000,
        "parent_access_count": 3,
        "root_decayed_count_hl_60s": ROOT_DECAYED,
        "root_time_since_extended_ms": 6000,
        "tier_rank": 1,  # DRAM, after HBM was removed
    },
    3: {
        "known": 1,
        "decayed_count_hl_10s": _decayed([0], 10),
        "decayed_count_hl_60s": _decayed([0], 60),
        "decayed_count_hl_600s": _decayed([0], 600),
        "decayed_count_hl_3600s": _decayed([0], 3600),
        "access_count": 1,
        "age_ms": 10_000,
        "time_since_last_access_ms": 10_000,
        "requests_since_last_access": 2,
        "depth": 2,
        "last_request_num_blocks": 3,
        "blocks_to_tail": 0,
        "ever_tail": 1,
        "last_request_input_tokens": 1500,
        "last_request_output_tokens": 100,
        "last_request_hit_fraction": 0.0,
        "turn_index": 1,
        "num_children": 0,
        "parent_time_since_last_access_ms": 6000,
        "parent_access_count": 3,
        "root_decayed_count_hl_60s": ROOT_DECAYED,
        "root_time_since_extended_ms": 6000,
        "tier_rank": 4,
    },
    5: {
        "known": 1,
        "gap_1_ms": 3000,
        "decayed_count_hl_10s": _decayed([1000, 4000], 10),
        "decayed_count_hl_60s": _decayed([1000, 4000], 60),
        "decayed_count_hl_600s": _decayed([1000, 4000], 600),
        "decayed_count_hl_3600s": _decayed([1000, 4000], 3600),
        "access_count": 2,
        "age_ms": 9000,
        "time_since_last_access_ms": 6000,
        "requests_since_last_access": 0,
        "depth": 3,
        "last_request_num_blocks": 5,
        "blocks_to_tail": 1,
        "ever_tail": 1,  # r1's tail
        "last_request_input_tokens": 2500,
        "last_request_output_tokens": 300,
        "last_request_hit_fraction": 4 / 5,
        "turn_index": 3,
        "turn_gap_ms": 3000,
        "num_children": 1,
        "time_since_child_access_ms": 6000,
        "time_since_extended_ms": 6000,
        "parent_time_since_last_access_ms": 6000,
        "parent_access_count": 2,
        "root_decayed_count_hl_60s": ROOT_DECAYED,
        "root_time_since_extended_ms": 6000,
        "tier_rank": 4,
    },
    99: {"known": 0, "tier_rank": 4},  # never seen: every block feature MISSING
}
REQUEST_LEVEL = {
    "request_rate_per_s_hl_10s": _rate(REQUESTS, 10),
    "request_rate_per_s_hl_60s": _rate(REQUESTS, 60),
    "block_access_rate_per_s_hl_60s": _rate(BLOCKS, 60),
}


@pytest.fixture(scope="module")
def rows() -> dict[int, dict[str, float]]:
    state = FeatureState()
    state.observe_many(_events())
    matrix = state.features_for(np.array(list(EXPECTED), dtype=np.uint64), NOW)
    assert matrix.dtype == np.float32 and matrix.shape == (len(EXPECTED), len(FEATURE_NAMES))
    return {
        h: dict(zip(FEATURE_NAMES, row.tolist(), strict=True))
        for h, row in zip(EXPECTED, matrix, strict=True)
    }


@pytest.mark.parametrize("block", list(EXPECTED))
def test_every_feature_matches_the_hand_computed_value(
    rows: dict[int, dict[str, float]], block: int
) -> None:
    # Features not listed for a block are MISSING (no gap, no child access ...).
    expected = {name: MISSING for name in FEATURE_NAMES} | EXPECTED[block] | REQUEST_LEVEL
    got = rows[block]
    mismatched = {
        name: (got[name], want)
        for name, want in expected.items()
        if not math.isclose(got[name], want, rel_tol=2e-6, abs_tol=1e-6)
    }
    assert not mismatched, f"block {block}: (got, expected) {mismatched}"


def test_accessors_for_baselines() -> None:
    state = FeatureState()
    state.observe_many(_events())
    hashes = np.array([2, 3, 99], dtype=np.uint64)
    assert state.last_access_ms(hashes).tolist() == [4000, 0, -1]
    assert state.access_count(hashes).tolist() == [3, 1, 0]
    assert state.root_last_access_ms(hashes).tolist() == [4000, 4000, -1]
    assert state.known(hashes).tolist() == [True, True, False]
    assert np.allclose(
        state.decayed_count(hashes, NOW, 60.0),
        [_decayed([0, 1000, 4000], 60), _decayed([0], 60), 0],
    )
    assert state.num_tracked == 6
    assert sorted(state.tracked_hashes().tolist()) == [1, 2, 3, 4, 5, 6]


def test_session_ids_give_the_turn_when_present() -> None:
    state = FeatureState()
    state.observe(BlocksAccessed(0, "a", (1, 2), 16, session_id="s"))
    state.observe(
        BlocksAccessed(10, "b", (7, 8), 16, session_id="s")
    )  # unrelated chain, same session
    state.observe(BlocksAccessed(20, "c", (1, 2, 3), 16, session_id="t"))
    turn = FEATURE_NAMES.index("turn_index")
    feats = state.features_for(np.array([8, 3], dtype=np.uint64), 20)
    assert feats[:, turn].tolist() == [2.0, 1.0]
    assert feats[:, FEATURE_NAMES.index("turn_gap_ms")].tolist() == [10.0, MISSING]


def test_all_blocks_cleared_forgets_every_tier() -> None:
    from features.events import AllBlocksCleared

    state = FeatureState()
    state.observe_many(_events())
    state.observe(AllBlocksCleared(5000))
    tier = FEATURE_NAMES.index("tier_rank")
    assert state.features_for(np.array([2], dtype=np.uint64), NOW)[0, tier] == 4


def test_cap_drops_the_coldest_blocks_first() -> None:
    params = FeatureParams(max_tracked_blocks=16, initial_capacity=4, evict_fraction=0.25)
    state = FeatureState(params)
    for i in range(16):
        state.observe(BlocksAccessed(i * 10, f"r{i}", (100 + i,), 16))
    state.observe(BlocksAccessed(500, "hot", (100,), 16))  # block 100 becomes the warmest
    state.observe(BlocksAccessed(600, "new", (200,), 16))  # full: drops 4 coldest = 101..104
    assert state.num_tracked == 13
    assert state.known(np.array([100, 101, 104, 105, 200], dtype=np.uint64)).tolist() == [
        True,
        False,
        False,
        True,
        True,
    ]
    assert state.num_evicted == 4


def test_a_child_of_an_evicted_parent_reports_no_parent() -> None:
    params = FeatureParams(max_tracked_blocks=16, initial_capacity=16, evict_fraction=1 / 16)
    state = FeatureState(params)
    state.observe(BlocksAccessed(0, "a", (1, 2), 16))
    parent_count = FEATURE_NAMES.index("parent_access_count")
    assert state.features_for(np.array([2], dtype=np.uint64), 0)[0, parent_count] == 1
    for i in range(14):
        state.observe(BlocksAccessed(20 + i, f"f{i}", (1000 + i,), 16))
    # Full: drops the one coldest; 1 and 2 tie on last access, the lower row (1) goes.
    state.observe(BlocksAccessed(50, "c", (3000,), 16))
    assert state.known(np.array([1, 2], dtype=np.uint64)).tolist() == [False, True]
    assert state.features_for(np.array([2], dtype=np.uint64), 60)[0, parent_count] == MISSING


def test_bad_params_say_what_to_fix() -> None:
    from features.state import FeatureParamsError

    with pytest.raises(FeatureParamsError, match="num_gaps"):
        FeatureParams(num_gaps=0)
    with pytest.raises(FeatureParamsError, match="60"):
        FeatureParams(half_lives_s=(10.0,))
