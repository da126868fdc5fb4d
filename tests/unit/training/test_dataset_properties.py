"""Properties of the offline builder against the online state, on generated traces.

- Online == offline: a FeatureState fed event by event gives, at every sampled
  instant, exactly the rows ``build_dataset`` wrote (same code path, same bits),
  including under the tracked-block cap (eviction) and with residency events.
- No leakage: deleting, or reshuffling, every event after time t changes no row
  at an instant <= t.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from features.events import BlockRemoved, BlocksAccessed, BlockStored, Tier
from features.state import FeatureParams, FeatureState
from training.dataset import Dataset, build_dataset

GAP_MS = st.sampled_from([0, 0, 1, 700, 3_000, 45_000, 400_000])


@st.composite
def traces(draw: st.DrawFn) -> list[object]:
    """Prefix-chained requests: a new conversation on one of a few roots, or the next
    turn of an earlier request (its prompt, minus maybe its tail, plus new blocks)."""
    num_requests = draw(st.integers(1, 40))
    next_id = 100
    chains: list[tuple[int, ...]] = []
    events: list[object] = []
    ts = draw(st.integers(0, 10**12))
    sessions = draw(st.booleans())
    for r in range(num_requests):
        ts += draw(GAP_MS)
        if chains and draw(st.booleans()):
            base = draw(st.sampled_from(chains))
            base = base[: draw(st.integers(1, min(len(base), 10)))]  # chains stay <= 16 blocks
        else:
            base = (draw(st.integers(0, 3)),)
        new = draw(st.integers(0, 6))
        chain = base + tuple(range(next_id, next_id + new))
        next_id += new
        chains.append(chain)
        events.append(
            BlocksAccessed(
                ts_ms=ts,
                request_id=f"r{r}",
                block_hashes=chain,
                block_size_tokens=16,
                input_tokens=draw(st.none() | st.integers(0, 9000)),
                output_tokens=draw(st.none() | st.integers(0, 900)),
                session_id=f"s{draw(st.integers(0, 4))}" if sessions else None,
            )
        )
        if draw(st.integers(0, 4)) == 0:
            tier = draw(st.sampled_from(list(Tier)))
            kind = BlockStored if draw(st.booleans()) else BlockRemoved
            hashes = chain[: draw(st.integers(1, len(chain)))]
            if kind is BlockStored:
                events.append(BlockStored(ts, hashes, None, 16, tier))
            else:
                events.append(BlockRemoved(ts, hashes, tier))
    return events


PARAMS = st.builds(
    FeatureParams,
    max_tracked_blocks=st.sampled_from([16, 24, 64, 10_000]),
    num_gaps=st.sampled_from([1, 3, 8]),
    initial_capacity=st.sampled_from([1, 8, 1024]),
    evict_fraction=st.sampled_from([1 / 16, 0.25, 0.5]),
)


def _replay_and_compare(events: list[object], params: FeatureParams, ds: Dataset) -> int:
    """Feed ``events`` to a fresh state one at a time; after each, recompute the rows the
    builder took at that point and compare bit for bit. Returns rows compared."""
    state = FeatureState(params)
    compared = 0
    for seen, event in enumerate(events, start=1):
        state.observe(event)
        rows = np.flatnonzero(ds.num_events_seen == seen)
        for ts in np.unique(ds.ts_ms[rows]):
            at = rows[ds.ts_ms[rows] == ts]
            online = state.features_for(ds.block_hashes[at], int(ts))
            np.testing.assert_array_equal(online, ds.X[at], err_msg=f"after event {seen}, t={ts}")
            compared += at.size
    return compared


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=traces(), params=PARAMS, interval=st.sampled_from([None, 20_000]))
def test_online_state_reproduces_every_offline_row(
    events: list[object], params: FeatureParams, interval: int | None
) -> None:
    ds = build_dataset(
        events, params=params, snapshot_interval_ms=interval, snapshot_blocks=5, seed=3
    )
    assert _replay_and_compare(events, params, ds) == ds.num_rows


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=traces(), params=PARAMS, data=st.data())
def test_no_row_at_or_before_t_depends_on_events_after_t(
    events: list[object], params: FeatureParams, data: st.DataObject
) -> None:
    times = [e.ts_ms for e in events]
    t = data.draw(st.sampled_from(times))
    head = [e for e in events if e.ts_ms <= t]
    tail = [e for e in events if e.ts_ms > t]
    kwargs = {"params": params, "snapshot_interval_ms": 30_000, "snapshot_blocks": 4, "seed": 5}
    full = build_dataset(events, **kwargs)
    before = int(np.searchsorted(full.ts_ms, t, side="right"))  # rows are in time order

    cut = build_dataset(head, **kwargs)
    n = cut.num_rows
    assert n <= before
    # Everything the cut trace produced is exactly the full trace's first rows ...
    np.testing.assert_array_equal(cut.X, full.X[:n])
    np.testing.assert_array_equal(cut.block_hashes, full.block_hashes[:n])
    # ... and only snapshots waiting for a later event can be missing.
    assert not (~full.is_snapshot[n:before]).any()

    # Reshuffle the future: permute the later requests' chains, keeping time order.
    moved = [i for i, e in enumerate(tail) if isinstance(e, BlocksAccessed)]
    perm = data.draw(st.permutations(moved))
    shuffled = list(tail)
    for i, j in zip(moved, perm, strict=True):
        shuffled[i] = replace(tail[i], block_hashes=tail[j].block_hashes)
    other = build_dataset(head + shuffled, **kwargs)
    np.testing.assert_array_equal(other.X[:before], full.X[:before])
    np.testing.assert_array_equal(other.block_hashes[:before], full.block_hashes[:before])


def test_snapshot_rows_describe_idle_tracked_blocks(small_trace) -> None:
    ds = build_dataset(small_trace, snapshot_interval_ms=30_000, snapshot_blocks=64, sample=0.2)
    snap = ds.is_snapshot
    assert snap.any() and (~snap).any()
    since = ds.X[:, ds.feature_names.index("time_since_last_access_ms")]
    # A snapshot is taken between requests: every sampled block is tracked and was last
    # read at or before the snapshot instant.
    assert (ds.X[snap, ds.feature_names.index("known")] == 1).all()
    assert (since[snap] >= 0).all()
    assert (since[~snap] == 0).all()  # access rows are taken at the access
