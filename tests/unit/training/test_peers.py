"""libCacheSim peers: the trace file they read, exact agreement with kvwarm's own LRU
and Belady, and that no peer can take the caller down."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from features.annotate import AccessArrays, access_arrays, next_access_index
from features.decoders import read_trace
from features.trace_stats import belady_hits, lru_hits
from training.peers import (
    ORACLE_GENERAL_DTYPE,
    PEER_POLICIES,
    UnknownPeerError,
    peer_hit_ratios,
    write_oracle_general,
)

libcachesim = pytest.importorskip("libcachesim")

# 1 2 3 1 4 1 2 5 1 2 3 4 5, dense ids in first-seen order.
TINY = np.array([0, 1, 2, 0, 3, 0, 1, 4, 0, 1, 2, 3, 4], dtype=np.int64)


@pytest.fixture(scope="module")
def small_arrays(small_trace: Path) -> AccessArrays:
    return access_arrays(read_trace(small_trace))


def test_tiny_sequence_hits_worked_by_hand() -> None:
    # Capacity 3. LRU hits: the 2nd '1', the 3rd '1', the 4th '1', the 3rd '2' -> 4.
    # Belady (always admit): as LRU plus the 2nd '2' (idx 6) and the last '5' -> 6.
    peers = peer_hit_ratios(TINY, 3, policies=("LRU", "Belady"))
    assert peers["LRU"].num_hits == lru_hits(TINY, 3) == 4
    assert peers["Belady"].num_hits == belady_hits(TINY, 3) == 6
    assert peers["LRU"].hit_ratio == pytest.approx(4 / 13)


@pytest.mark.parametrize("capacity", [1, 2])
def test_tiny_sequence_matches_kvwarm_exactly(capacity: int) -> None:
    peers = peer_hit_ratios(TINY, capacity, policies=("LRU", "Belady"))
    assert peers["LRU"].num_hits == lru_hits(TINY, capacity)
    assert peers["Belady"].num_hits == belady_hits(TINY, capacity)


def test_libcachesim_belady_always_admits() -> None:
    # 0 1 0 at one block: admitting 1 evicts 0 (0 hits); refusing it keeps 0 (1 hit).
    ids = np.array([0, 1, 0], dtype=np.int64)
    assert peer_hit_ratios(ids, 1, policies=("Belady",))["Belady"].num_hits == 0
    assert belady_hits(ids, 1) == 0 and belady_hits(ids, 1, bypass=True) == 1


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.1])
def test_generated_trace_matches_kvwarm_exactly(
    small_arrays: AccessArrays, fraction: float
) -> None:
    ids = small_arrays.block_ids
    capacity = int(fraction * small_arrays.num_distinct)
    peers = peer_hit_ratios(ids, capacity, policies=("LRU", "Belady"), ts_ms=small_arrays.ts_ms)
    lru, belady = lru_hits(ids, capacity), belady_hits(ids, capacity)
    assert peers["LRU"].num_hits == lru
    assert peers["Belady"].num_hits == belady
    assert belady_hits(ids, capacity, bypass=True) >= peers["Belady"].num_hits > lru


def test_oracle_general_file_reads_back_through_libcachesim(tmp_path: Path) -> None:
    ids = np.array([5, 7, 5, 9, 7, 5], dtype=np.int64)
    ts_ms = np.array([1000, 1500, 2000, 4999, 5000, 9000], dtype=np.int64)
    path = write_oracle_general(tmp_path / "t.bin", ids, ts_ms)
    assert path.stat().st_size == ids.shape[0] * ORACLE_GENERAL_DTYPE.itemsize == 6 * 24
    reader = libcachesim.TraceReader(
        str(path), trace_type=libcachesim.TraceType.ORACLE_GENERAL_TRACE
    )
    requests = list(reader)
    assert [r.obj_id for r in requests] == (ids + 1).tolist()
    assert [r.obj_size for r in requests] == [1] * 6
    assert [r.clock_time for r in requests] == [0, 0, 1, 3, 4, 8]
    never = np.iinfo(np.int64).max  # the reader maps the file's -1 to INT64_MAX
    nxt = next_access_index(ids)
    expected = [int(v) if v < ids.shape[0] else never for v in nxt]
    assert [r.next_access_vtime for r in requests] == expected == [2, 4, 5, never, never, never]


def test_online_peers_read_no_future(tmp_path: Path) -> None:
    path = write_oracle_general(tmp_path / "blind.bin", TINY, annotate=False)
    records = np.fromfile(path, dtype=ORACLE_GENERAL_DTYPE)
    assert (records["next_access_vtime"] == -1).all()
    assert [name for name, p in PEER_POLICIES.items() if p.needs_future] == ["Belady"]


def test_every_peer_reports_a_ratio_or_why_not(small_arrays: AccessArrays) -> None:
    ids = small_arrays.block_ids[:5_000]
    capacity = 200
    peers = peer_hit_ratios(ids, capacity, ts_ms=small_arrays.ts_ms[:5_000])
    assert list(peers) == list(PEER_POLICIES)
    for name, result in peers.items():
        assert result.name == name and result.num_accesses == 5_000
        if result.available:
            assert 0.0 <= result.hit_ratio <= 1.0, name
            assert result.elapsed_s >= 0.0
        else:
            assert result.error, name
    # Nothing online beats Belady, and the two references are exact.
    optimum = peers["Belady"].hit_ratio
    assert all(r.hit_ratio <= optimum for r in peers.values() if r.available)
    assert peers["LRU"].num_hits == lru_hits(ids, capacity)
    assert peers["Belady"].num_hits == belady_hits(ids, capacity)


def test_a_crash_in_c_is_reported_and_the_rest_still_run() -> None:
    # S3-FIFO in libCacheSim 0.3.5 aborts when its small FIFO rounds to 0 blocks.
    peers = peer_hit_ratios(TINY, 1, policies=("S3-FIFO", "LRU", "Belady"))
    s3 = peers["S3-FIFO"]
    assert not s3.available and np.isnan(s3.hit_ratio) and s3.num_hits is None
    assert "crashed" in (s3.error or "") and "SIGABRT" in (s3.error or "")
    assert "Invalid cache size configuration" in (s3.error or "")
    assert peers["LRU"].num_hits == lru_hits(TINY, 1)
    assert peers["Belady"].num_hits == belady_hits(TINY, 1)


def test_randomised_peers_repeat_exactly(small_arrays: AccessArrays) -> None:
    ids = small_arrays.block_ids[:5_000]
    names = ("LHD", "LeCaR", "Cacheus")
    first = peer_hit_ratios(ids, 200, policies=names)
    second = peer_hit_ratios(ids, 200, policies=names)
    assert {n: r.num_hits for n, r in first.items()} == {n: r.num_hits for n, r in second.items()}


def test_unknown_peer_lists_the_valid_names() -> None:
    with pytest.raises(UnknownPeerError, match="S3-FIFO"):
        peer_hit_ratios(TINY, 2, policies=("S3FIFO",))
