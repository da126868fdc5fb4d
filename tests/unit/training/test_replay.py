from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from executor.sim.profile import load_profile
from features.decoders import read_trace
from features.generator import generate_to_file, params_for
from predictor.oracle import FutureAccesses
from predictor.registry import make_policy
from training.replay import (
    distinct_blocks,
    lru_request_hits_by_request,
    reference_hit_ratios,
    replay_single_tier,
    rescale_time,
    single_tier_references,
    split_events,
    spread_ties,
    time_scale_for_load,
)
from training.tiered import TieredSetup, replay_tiered, time_scale_for_engine_load


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    path = tmp_path_factory.mktemp("planted") / "planted.jsonl"
    generate_to_file(params_for("planted", num_requests=1800, seed=11), path)
    events = spread_ties(list(read_trace(path)))
    return split_events(events, 0.5)


def _warm(name, train, future=None):
    policy = make_policy(name, **({"future": future} if future is not None else {}))
    policy.observe_many(train)
    return policy


def test_spread_ties_keeps_order_and_makes_time_strictly_increase_within_ticks():
    from features.events import BlocksAccessed

    events = [
        BlocksAccessed(ts_ms=t, request_id=str(i), block_hashes=(i,), block_size_tokens=1)
        for i, t in enumerate([0, 0, 0, 3000, 3000, 9000])
    ]
    spread = spread_ties(events)
    assert [e.ts_ms for e in spread] == [0, 1000, 2000, 3000, 6000, 9000]
    assert [e.request_id for e in spread] == [e.request_id for e in events]


def test_split_is_by_time_and_loses_nothing(planted):
    train, test = planted
    assert train and test
    assert train[-1].ts_ms <= test[0].ts_ms


def test_no_policy_beats_belady_with_bypass(planted):
    train, test = planted
    future = FutureAccesses.from_events(train + test)
    capacity = max(1, int(0.01 * distinct_blocks(test)))
    refs = reference_hit_ratios(test, capacity)
    assert refs["lru_exact"] <= refs["belady"] <= refs["belady_bypass"]
    for name in ("lru", "lfu", "prefix_lru", "oracle"):
        result = replay_single_tier(
            _warm(name, train, future if name == "oracle" else None), test, capacity
        )
        # Belady with bypass is the optimum for equal-size blocks: a policy above it saw
        # the future (or the replay leaks it).
        assert result.hit_ratio <= refs["belady_bypass"] + 1e-12, name
    oracle = replay_single_tier(_warm("oracle", train, future), test, capacity)
    lru = replay_single_tier(_warm("lru", train), test, capacity)
    assert oracle.hit_ratio > lru.hit_ratio


def test_single_tier_replay_is_deterministic(planted):
    train, test = planted
    capacity = max(1, int(0.05 * distinct_blocks(test)))
    a = replay_single_tier(_warm("lfu", train), test, capacity)
    b = replay_single_tier(_warm("lfu", train), test, capacity)
    assert (a.hits, a.moves_by_kind) == (b.hits, b.moves_by_kind)


def test_sampled_lru_through_the_planner_tracks_exact_lru(planted):
    train, test = planted
    capacity = max(1, int(0.05 * distinct_blocks(test)))
    exact = reference_hit_ratios(test, capacity)["lru_exact"]
    sampled = replay_single_tier(_warm("lru", train), test, capacity).hit_ratio
    assert abs(sampled - exact) < 0.02


def test_hits_are_kept_request_by_request_and_lru_matches_exact_lru_at_each(planted):
    train, test = planted
    capacity = max(1, int(0.05 * distinct_blocks(test)))
    exact = single_tier_references(test, capacity)[1].lru_exact
    assert exact.shape == (len(test),)
    assert exact.sum() / sum(len(e.block_hashes) for e in test) == pytest.approx(
        reference_hit_ratios(test, capacity)["lru_exact"]
    )
    lru = replay_single_tier(_warm("lru", train), test, capacity)
    assert lru.hits_by_request.tolist() == exact.tolist()  # exact recency, request by request
    lfu = replay_single_tier(_warm("lfu", train), test, capacity)
    assert lfu.hits_by_request.sum() == lfu.hits and lfu.hits_by_request.tolist() != exact.tolist()


def test_lru_through_the_planner_counts_a_requests_hits_at_its_arrival(planted):
    """Where requests are long against the cache, exact LRU access by access evicts,
    while storing a request's first missing blocks, blocks it reads further on; the
    replay counts what is there when the request arrives, and its LRU is that LRU."""
    from features.events import BlocksAccessed

    train, test = planted
    capacity = max(2, max(len(e.block_hashes) for e in test) // 2)
    replayed = replay_single_tier(_warm("lru", train), test, capacity)
    assert replayed.hits_by_request.tolist() == lru_request_hits_by_request(test, capacity).tolist()
    # Three blocks of room: [1, 2, 3], then [4, 1, 2]. Access by access, storing 4
    # evicts 1, storing 1 evicts 2: no hit. Counted at arrival, 1 and 2 are there.
    events = [
        BlocksAccessed(ts_ms=1_000 * i, request_id=str(i), block_hashes=b, block_size_tokens=16)
        for i, b in enumerate([(1, 2, 3), (4, 1, 2)])
    ]
    assert single_tier_references(events, 3)[1].lru_exact.tolist() == [0, 0]
    assert lru_request_hits_by_request(events, 3).tolist() == [0, 2]
    assert replay_single_tier(make_policy("lru"), events, 3).hits_by_request.tolist() == [0, 2]


def test_the_engine_load_counts_decode_work(planted):
    """The open-loop load counts decode as well as prefill: the time scale is the
    prefill-only one stretched by the engine's busy / prefill ratio there, so it is
    longer when decoding costs steps, and the same when it costs next to nothing."""
    profile = load_profile()
    _, test = planted
    base = time_scale_for_load(test, profile.model.prefill_ms, 0.9)
    assert time_scale_for_engine_load(test, profile, 0.9) > 1.05 * base
    one_token = [dataclasses.replace(e, output_tokens=1) for e in test]
    no_overhead = profile.with_model(step_overhead_ms=0.0)
    assert time_scale_for_engine_load(one_token, no_overhead, 0.9) == pytest.approx(base, rel=0.01)


@pytest.fixture(scope="module")
def tiered_inputs(planted):
    profile = load_profile()
    train, test = planted
    scale = time_scale_for_load(test, profile.model.prefill_ms, 0.8)
    events = rescale_time(train + test, scale)
    train, test = events[: len(train)], events[len(train) :]
    setup = TieredSetup(
        profile=profile, hbm_capacity_blocks=max(1, int(0.02 * distinct_blocks(test)))
    )
    return train, test, setup, FutureAccesses.from_events(events)


def test_tiered_replay_accounts_every_access_and_holds_capacities(tiered_inputs):
    train, test, setup, _ = tiered_inputs
    result = replay_tiered(_warm("lru", train), test, setup)
    assert result.accesses == sum(len(set(e.block_hashes)) for e in test)
    assert sum(result.hits_by_tier.values()) <= result.accesses
    assert result.ttft_ms.shape == (len(test),) and (result.ttft_ms > 0).all()
    assert result.moves_by_kind.get("store", 0) > 0


def test_prewarming_at_arrival_never_hurts_ttft_and_the_oracle_leads(tiered_inputs):
    train, test, setup, future = tiered_inputs
    cold = replay_tiered(_warm("lru", train), test, setup, prewarm=False, speculative=False)
    warm = replay_tiered(_warm("lru", train), test, setup, prewarm=True, speculative=False)
    oracle = replay_tiered(_warm("oracle", train, future), test, setup)
    # The same placements; only when loads are booked differs: at arrival they overlap
    # the queueing. Per request this no longer dominates: in a continuously batched
    # engine a request whose prefix landed early takes prefill budget ahead of an
    # older one still loading, and loads booked at arrival compete with the ones of
    # requests already scheduled (this trace at MFU 0.09: p90 2.6% and mean 0.2%
    # worse). The median must improve and the mean stay within 1%.
    assert warm.hits_by_tier == cold.hits_by_tier
    w, c = warm.ttft_percentiles(), cold.ttft_percentiles()
    assert w["p50"] < c["p50"]
    assert w["mean"] < 1.01 * c["mean"]
    for r in (cold, warm, oracle):  # every decision went through and applied
        assert r.placement_mismatches == 0
        assert all(k.endswith("/applied") for k in r.decision_outcomes), r.decision_outcomes
    assert oracle.hit_ratio("hbm") > warm.hit_ratio("hbm")
    # Exact LRU keeps nearly every returning block in DRAM here (38 NVMe reads of
    # 15,019), so what the oracle adds is HBM over DRAM reads: a lower median, and a
    # mean within the same 1% as prewarming's (7,174 against 7,155 ms).
    o = oracle.ttft_percentiles()
    assert o["p50"] < c["p50"]
    assert o["mean"] < 1.01 * c["mean"]


def test_tiered_replay_is_deterministic(tiered_inputs):
    train, test, setup, _ = tiered_inputs
    a = replay_tiered(_warm("prefix_lru", train), test, setup)
    b = replay_tiered(_warm("prefix_lru", train), test, setup)
    assert np.array_equal(a.ttft_ms, b.ttft_ms) and a.moves_by_kind == b.moves_by_kind


def test_the_tiered_table_pairs_each_policy_with_lru_prewarm_and_prints_the_interval(
    tiered_inputs,
):
    from training.report import ComparisonReport, format_tiered, tiered_rows

    train, test, setup, future = tiered_inputs
    cold = replay_tiered(_warm("lru", train), test, setup, prewarm=False, speculative=False)
    warm = replay_tiered(_warm("lru", train), test, setup)
    oracle = replay_tiered(_warm("oracle", train, future), test, setup)
    rows = tiered_rows([cold, cold, warm, oracle], setup, fraction=0.02)
    assert "paired_vs_lru_prewarm" not in rows[2]  # LRU with prewarm is the base
    paired = rows[3]["paired_vs_lru_prewarm"]
    assert paired["faster"] + paired["slower"] <= len(test)
    lo, hi = paired["p50_ratio_ci95"]
    ratio = rows[3]["ttft_ms"]["p50"] / rows[2]["ttft_ms"]["p50"]
    assert lo <= hi and lo <= ratio * 1.05 and ratio <= hi * 1.05
    table = format_tiered(ComparisonReport(config={}, trace={}, tiered=rows))
    oracle_line = next(line for line in table.splitlines() if " oracle " in line)
    assert oracle_line.endswith(f"{lo:.3f}-{hi:.3f}")
    assert table.splitlines()[4].endswith(" -")  # the base row has no interval


def test_a_tiered_row_says_what_the_guard_served_and_its_estimates_at_both_scales(
    tiered_inputs,
):
    from predictor.guard import GuardedPolicy, GuardParams, memory_capacity_blocks
    from training.report import _tiered_job

    train, test, setup, _ = tiered_inputs
    outer = memory_capacity_blocks(setup.profile.tier_names, setup.capacities_blocks())
    params = GuardParams(capacity_blocks=setup.hbm_capacity_blocks, outer_capacity_blocks=outer)
    guarded = GuardedPolicy(params, {"lru": _warm("lru", train), "lfu": _warm("lfu", train)})
    row = _tiered_job(guarded, test, setup, {"label": "guarded"}).to_dict()
    assert row["guard"]["chosen"] in ("lru", "lfu")
    assert set(row["guard"]["estimated_hit_ratio_by_scale"]) == {"fastest", "outer"}
    plain = _tiered_job(_warm("lru", train), test, setup, {"label": "lru"}).to_dict()
    assert "guard" not in plain  # only a guarded policy reports one
