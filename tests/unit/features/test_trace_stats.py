from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from features.annotate import access_arrays, next_access_index
from features.decoders import read_trace
from features.trace_stats import belady_hits, lru_hit_flags, lru_hits, trace_stats
from serving.cli import main

# Requests [1,2] [3] [1,2] [4] [1,3]: accesses 1,2,3,1,2,4,1,3 (worked by hand below).
TINY = [[1, 2], [3], [1, 2], [4], [1, 3]]


@pytest.fixture
def tiny_trace(tmp_path):
    path = tmp_path / "tiny.jsonl"
    rows = [
        {"timestamp": 1000 * i, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}
        for i, ids in enumerate(TINY)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_next_access_index():
    ids = np.array([1, 2, 3, 1, 2, 4, 1, 3])
    assert next_access_index(ids).tolist() == [3, 4, 7, 6, 8, 8, 8, 8]


def test_golden_hits_on_tiny_trace(tiny_trace):
    arrays = access_arrays(read_trace(tiny_trace))
    ids = arrays.block_ids
    assert ids.tolist() == [0, 1, 2, 0, 1, 3, 0, 2]  # dense ids in first-seen order
    # LRU with 2 slots never keeps what comes back: 0 hits.
    assert lru_hits(ids, 2) == 0
    # Belady, always admit: hits at accesses 4 (block 1) and 7 (block 1 again).
    assert belady_hits(ids, 2) == 2
    # With bypass it refuses block 3 and block 4: hits on 1, 2, 1.
    assert belady_hits(ids, 2, bypass=True) == 3
    # With room for everything both reach the infinite cache: 8 accesses - 4 distinct.
    assert lru_hits(ids, 4) == belady_hits(ids, 4) == 4
    assert lru_hits(ids, 0) == belady_hits(ids, 0) == 0
    # Which accesses hit: with 3 slots, block 0 and 1 come back before they leave, block 2
    # has been pushed out by then (accesses 0 1 2 0 1 3 0 2).
    assert lru_hit_flags(ids, 3).tolist() == [False, False, False, True, True, False, True, False]
    assert lru_hit_flags(ids, 0).tolist() == [False] * 8


def test_trace_stats_on_tiny_trace(tiny_trace):
    stats = trace_stats(access_arrays(read_trace(tiny_trace)), (0.5,))
    assert stats.num_requests == 5
    assert stats.num_block_accesses == 8
    assert stats.num_distinct_blocks == 4
    assert stats.infinite_cache_hit_ratio == 0.5
    assert stats.time_span_s == 4.0
    assert stats.reuse_distance_requests["p50"] == 2.0  # distances 2, 2, 2, 3
    row = stats.capacities[0]
    assert (row.capacity_blocks, row.lru_hit_ratio, row.belady_hit_ratio) == (2, 0.0, 0.25)


def test_lru_and_belady_bounds_on_generated_trace(small_trace):
    arrays = access_arrays(read_trace(small_trace))
    nxt = next_access_index(arrays.block_ids)
    infinite = arrays.num_accesses - arrays.num_distinct
    for cap in (10, 100, 1000):
        lru, bel = lru_hits(arrays.block_ids, cap), belady_hits(arrays.block_ids, cap, nxt)
        bypass = belady_hits(arrays.block_ids, cap, nxt, bypass=True)
        assert lru <= bel <= bypass <= infinite


def test_stats_cli_json(tiny_trace):
    result = CliRunner().invoke(main, ["stats", str(tiny_trace), "--capacities", "0.5", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["num_block_accesses"] == 8
    assert data["capacities"][0]["belady_hit_ratio"] == 0.25


def test_stats_cli_rejects_bad_capacities(tiny_trace):
    result = CliRunner().invoke(main, ["stats", str(tiny_trace), "--capacities", "0,2"])
    assert result.exit_code != 0
    assert "each fraction must be in (0, 1]" in result.output


def test_shared_trace_figures(shared_trace):
    """The figures the project is measured against (issue: spine, `kvwarm stats`)."""
    stats = trace_stats(access_arrays(read_trace(shared_trace)), (0.01, 0.05))
    assert stats.num_requests == 12_031
    assert stats.num_block_accesses == 288_500
    assert stats.num_distinct_blocks == 182_790
    assert round(stats.infinite_cache_hit_ratio, 4) == 0.3664
    one, five = stats.capacities
    assert (round(one.lru_hit_ratio, 4), round(one.belady_hit_ratio, 4)) == (0.0523, 0.2463)
    assert (round(five.lru_hit_ratio, 4), round(five.belady_hit_ratio, 4)) == (0.1954, 0.3664)
    assert stats.reuse_distance_requests["p50"] == 384
