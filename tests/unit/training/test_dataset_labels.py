"""Labels and splits of ``build_dataset`` against brute force on generated traces."""

from __future__ import annotations

import numpy as np
import pytest

from features.annotate import NEVER
from features.decoders import decode_mooncake
from features.events import BlocksAccessed
from features.feature_set import FEATURE_VERSION
from features.generator import generate, params_for
from training.dataset import Dataset, DatasetError, build_dataset, split_by_time

HORIZONS = (5_000, 60_000, 600_000)


def _trace(profile: str, seed: int, num_requests: int = 160) -> list[BlocksAccessed]:
    rows = generate(params_for(profile, num_requests=num_requests, seed=seed))
    return [decode_mooncake(row, str(i)) for i, row in enumerate(rows)]


def _brute_force(
    events: list[BlocksAccessed], ds: Dataset, end_ts_ms: int
) -> dict[str, np.ndarray]:
    """For each row, scan the requests after the row's instant for its block."""
    blocks = [set(e.block_hashes) for e in events]
    ttn, cens = [], []
    for seen, ts, h in zip(ds.num_events_seen, ds.ts_ms, ds.block_hashes.tolist(), strict=True):
        nxt = next(
            (e.ts_ms for e, b in zip(events[seen:], blocks[seen:], strict=True) if h in b), None
        )
        if nxt is None or nxt > end_ts_ms:
            ttn.append(end_ts_ms - ts)
            cens.append(True)
        else:
            ttn.append(nxt - ts)
            cens.append(False)
    out = {"time_to_next_access_ms": np.array(ttn), "censored": np.array(cens)}
    for h in HORIZONS:
        out[f"reused_within_{h}ms"] = (
            ~out["censored"] & (out["time_to_next_access_ms"] <= h)
        ).astype(np.uint8)
        out[f"horizon_complete_{h}ms"] = (out[f"reused_within_{h}ms"] == 1) | (
            ds.ts_ms + h <= end_ts_ms
        )
    return out


@pytest.mark.parametrize(("profile", "seed"), [("chat", 1), ("mixed", 2), ("agent", 3)])
def test_labels_match_brute_force(profile: str, seed: int) -> None:
    events = _trace(profile, seed)
    ds = build_dataset(
        events,
        horizons_ms=HORIZONS,
        sample=0.5,
        snapshot_interval_ms=20_000,
        snapshot_blocks=16,
        seed=seed,
    )
    assert ds.is_snapshot.any() and ds.labels["reused_within_60000ms"].any()
    assert ds.end_ts_ms == events[-1].ts_ms
    expected = _brute_force(events, ds, ds.end_ts_ms)
    for name, want in expected.items():
        np.testing.assert_array_equal(ds.labels[name], want, err_msg=name)


def test_split_parts_are_consecutive_and_labels_stop_at_each_boundary() -> None:
    events = _trace("chat", 4, num_requests=300)
    ds = build_dataset(events, horizons_ms=HORIZONS, snapshot_interval_ms=20_000, snapshot_blocks=8)
    parts = split_by_time(ds, (0.6, 0.2, 0.2))
    assert sum(p.num_rows for p in parts) == ds.num_rows
    assert [round(p.num_rows / ds.num_rows, 1) for p in parts] == [0.6, 0.2, 0.2]
    for earlier, later in zip(parts, parts[1:], strict=False):
        assert earlier.ts_ms.max() <= earlier.end_ts_ms < later.ts_ms.min()
    for part in parts:
        nxt = part.labels["next_access_ts_ms"]
        assert ((nxt == NEVER) | (nxt <= part.end_ts_ms)).all()  # no label looks past its part
        expected = _brute_force(events, part, part.end_ts_ms)
        for name, want in expected.items():
            np.testing.assert_array_equal(part.labels[name], want, err_msg=name)
    # Censoring at the boundary really happens: some train rows are reused only later.
    train_in_full = ds.labels["censored"][ds.ts_ms <= parts[0].end_ts_ms]
    assert parts[0].labels["censored"].sum() > train_in_full.sum()


def test_save_load_round_trip_and_version_check(tmp_path) -> None:
    ds = build_dataset(_trace("rag", 5, num_requests=60), snapshot_interval_ms=None)
    path = ds.save(tmp_path / "ds.npz")
    back = Dataset.load(path)
    assert back.feature_version == FEATURE_VERSION and back.feature_names == ds.feature_names
    np.testing.assert_array_equal(back.X, ds.X)
    for name, values in ds.labels.items():
        np.testing.assert_array_equal(back.labels[name], values)
    assert back.params["num_gaps"] == 8
    with pytest.raises(DatasetError, match="rebuild"):
        Dataset.load(path, expect_version=FEATURE_VERSION + 1)


def test_tiny_trace_labels_by_hand() -> None:
    events = [
        BlocksAccessed(0, "r0", (1, 2, 3), 512),
        BlocksAccessed(1000, "r1", (1, 2, 4), 512),
        BlocksAccessed(4000, "r2", (1, 5), 512),
    ]
    ds = build_dataset(events, horizons_ms=(3000,), snapshot_interval_ms=None)
    assert ds.block_hashes.tolist() == [1, 2, 3, 1, 2, 4, 1, 5]
    assert ds.labels["time_to_next_access_ms"].tolist() == [
        1000,
        1000,
        4000,
        3000,
        3000,
        3000,
        0,
        0,
    ]
    assert ds.labels["censored"].tolist() == [False, False, True, False, True, True, True, True]
    assert ds.labels["reused_within_3000ms"].tolist() == [1, 1, 0, 1, 0, 0, 0, 0]
    # Block 2 at t=1000 is never read again and 1000 + 3000 <= 4000: a known "no".
    assert ds.labels["horizon_complete_3000ms"].tolist() == [
        True,
        True,
        True,
        True,
        True,
        True,
        False,
        False,
    ]


def test_bad_arguments_say_what_to_change() -> None:
    with pytest.raises(DatasetError, match="sample"):
        build_dataset([], sample=0)
    with pytest.raises(DatasetError, match="no rows"):
        build_dataset([])
