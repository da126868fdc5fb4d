"""Properties of FeatureState on generated event streams.

- ``observe_many`` (batched) leaves exactly the state ``observe`` one event at a time
  does, bit for bit, including under the cap and across decayed-counter rescaling.
- Memory stays bounded by the cap; every query returns a valid row, never raises.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from features.events import AllBlocksCleared, BlockRemoved, BlocksAccessed, BlockStored, Tier
from features.feature_set import MISSING
from features.state import FeatureParams, FeatureState

GAP_MS = st.sampled_from([0, 0, 0, 1, 900, 3_000, 60_000, 700_000])


@st.composite
def streams(draw: st.DrawFn) -> list[object]:
    """Prefix-chained requests (new conversations, next turns of earlier ones, some
    chains with a repeated hash) mixed with residency events."""
    events: list[object] = []
    chains: list[tuple[int, ...]] = []
    next_id = 1000
    ts = draw(st.integers(0, 10**12))
    for r in range(draw(st.integers(1, 120))):
        ts += draw(GAP_MS)
        roll = draw(st.integers(0, 19))
        if roll == 0:
            events.append(
                draw(st.sampled_from([AllBlocksCleared(ts), BlockRemoved(ts, (1, 2), Tier.DRAM)]))
            )
            continue
        if roll == 1 and chains:
            events.append(
                BlockStored(
                    ts, draw(st.sampled_from(chains)), None, 16, draw(st.sampled_from(list(Tier)))
                )
            )
            continue
        if chains and draw(st.booleans()):
            base = draw(st.sampled_from(chains))
            base = base[: draw(st.integers(1, min(len(base), 18)))]
        else:
            base = (draw(st.integers(0, 5)),)
        new = draw(st.integers(0, 12))
        chain = base + tuple(range(next_id, next_id + new))
        if roll == 2:
            chain = chain + chain[:1]  # a repeated hash inside one request
        if roll == 3:
            chain = ()
        next_id += new
        if chain:
            chains.append(chain)
        events.append(
            BlocksAccessed(
                ts,
                f"r{r}",
                chain,
                16,
                draw(st.none() | st.integers(0, 10**5)),
                None,
                draw(st.none() | st.sampled_from(["a", "b"])),
            )
        )
    return events


PARAMS = st.builds(
    FeatureParams,
    max_tracked_blocks=st.sampled_from([40, 100, 100_000]),  # > any request's length
    num_gaps=st.sampled_from([1, 2, 8]),
    initial_capacity=st.sampled_from([1, 16, 4096]),
    evict_fraction=st.sampled_from([1 / 16, 0.3]),
    half_lives_s=st.sampled_from([(1.0, 60.0), (10.0, 60.0, 600.0, 3600.0)]),
)


def _assert_same_state(a: FeatureState, b: FeatureState) -> None:
    assert a._index == b._index
    assert a._free == b._free and a._high_water == b._high_water
    for x, y in zip(a._arrays(), b._arrays(), strict=True):
        np.testing.assert_array_equal(x[: a._high_water], y[: b._high_water])
    assert (a.num_requests, a.num_accesses, a.num_evicted) == (
        b.num_requests,
        b.num_accesses,
        b.num_evicted,
    )
    assert (a._req_counts, a._block_count, a.clock_ms) == (
        b._req_counts,
        b._block_count,
        b.clock_ms,
    )
    assert (a._dec_epoch_ms, a._sessions) == (b._dec_epoch_ms, b._sessions)
    np.testing.assert_array_equal(a.last_request_slots, b.last_request_slots)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=streams(), params=PARAMS)
def test_batched_observe_many_equals_one_by_one(
    events: list[object], params: FeatureParams
) -> None:
    one = FeatureState(params)
    for event in events:
        one.observe(event)
    many = FeatureState(params)
    many.observe_many(events)
    _assert_same_state(one, many)
    hashes = np.array(sorted(set(one._index) | {0, 2**64 - 1}), dtype=np.uint64)
    now = max(e.ts_ms for e in events) + 1234
    np.testing.assert_array_equal(one.features_for(hashes, now), many.features_for(hashes, now))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=streams(), params=PARAMS, probe=st.lists(st.integers(0, 2**64 - 1), max_size=20))
def test_bounded_and_every_query_gets_a_valid_row(
    events: list[object], params: FeatureParams, probe: list[int]
) -> None:
    state = FeatureState(params)
    state.observe_many(events)
    assert state.num_tracked <= params.max_tracked_blocks
    assert state._hash.shape[0] <= params.max_tracked_blocks
    hashes = np.array(probe + sorted(state._index)[:20], dtype=np.uint64)
    for now in (0, max(e.ts_ms for e in events)):
        rows = state.features_for(hashes, now)
        assert rows.shape == (hashes.size, len(params.feature_names)) and rows.dtype == np.float32
        assert np.isfinite(rows).all()
        known = state.known(hashes)
        names = params.feature_names
        block_cols = [
            i
            for i, n in enumerate(names)
            if n not in ("known", "tier_rank")
            and not n.startswith(("request_rate", "block_access_rate"))
        ]
        assert (rows[~known][:, block_cols] == MISSING).all()
        assert (rows[:, names.index("known")] == known).all()


def test_bytes_per_tracked_block_within_budget_on_real_sized_state(small_trace) -> None:
    from features.decoders import read_trace

    state = FeatureState()
    state.observe_many(read_trace(small_trace))
    assert state.num_tracked > 10_000
    assert state.bytes_per_tracked_block() <= 256
