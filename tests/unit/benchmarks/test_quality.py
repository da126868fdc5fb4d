"""The quality suite on two planted workloads: one where only recency matters, one where
sessions return after a fixed gap behind scans. The guarded model must keep LRU's hit
ratio on the first (within the safety tolerance) and close part of the gap on the
second; the leak check runs on both."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from benchmarks.quality import (
    SAFETY_TOLERANCE,
    LeakError,
    leak_check,
    markdown,
    run_workload,
    summarize,
    workload_events,
)
from features.events import BlocksAccessed


def recency_workload(num_requests: int = 1_500, seed: int = 3) -> list[BlocksAccessed]:
    """Each request re-reads one of the last 6 requests' chains (60%) or starts a new one."""
    rng = np.random.default_rng(seed)
    chains: list[tuple[int, ...]] = []
    events = []
    next_block = 0
    for i in range(num_requests):
        if chains and rng.random() < 0.6:
            chain = chains[-1 - int(rng.integers(0, min(6, len(chains))))]
        else:
            chain = tuple(range(next_block, next_block + 10))
            next_block += 10
            chains.append(chain)
        events.append(
            BlocksAccessed(
                ts_ms=2_000 * i, request_id=str(i), block_hashes=chain, block_size_tokens=16
            )
        )
    return events


@pytest.fixture(scope="module")
def suite():
    planted, _ = workload_events("planted", 1_000, seed=11)
    common = dict(policies=("lru", "lightgbm"), capacities=(0.05, 0.1), peers=False, quick=True)
    return {
        "recency": run_workload(recency_workload(), guard=True, **common),
        "planted": run_workload(planted, guard=True, **common),
    }


def test_guarded_model_keeps_lru_where_recency_wins_and_gains_where_prediction_does(suite):
    summary = summarize(suite, ("lru", "lightgbm"))
    learned = summary["lightgbm"]
    assert learned["worst_diff_to_lru"] >= -SAFETY_TOLERANCE, learned
    assert learned["safe"]
    planted_gain = [
        row["policies"]["lightgbm"] - row["references"]["lru_exact"] for row in suite["planted"]
    ]
    assert min(planted_gain) > 0.01, planted_gain
    table = markdown(suite, summary)
    assert "| recency | 5% |" in table and "| lightgbm |" in table


def test_the_leak_check_passes_real_rows_and_refuses_one_above_belady_with_bypass(suite):
    for rows in suite.values():
        leak_check(rows)
    row = dict(suite["recency"][0])
    row["policies"] = {**row["policies"], "lightgbm": row["references"]["belady_bypass"] + 0.01}
    with pytest.raises(LeakError, match="reads the future"):
        leak_check([row])


def test_unknown_workload_is_refused_with_the_valid_names():
    from serving.cli import main

    out = CliRunner().invoke(main, ["bench", "quality", "--workloads", "nope"])
    assert out.exit_code != 0 and "sharedprefix" in out.output
