"""Share of the LRU-to-Belady hit-ratio gap a learned policy closes (issue 8 goal).

Trains on the first 60% (by time) of the shared Mooncake conversation trace, replays
the last 40% from an empty cache at 1%, 5% and 10% of its distinct blocks through the
one planner, and prints hit ratios next to exact LRU and Belady.

Run: .venv/bin/python -m benchmarks.single_tier_gap [lightgbm|lstm] [horizon_ms]
"""

from __future__ import annotations

import copy
import sys
import time

from benchmarks.traces import shared_trace_path
from features.decoders import read_trace
from training.replay import (
    distinct_blocks,
    gap_closed,
    reference_hit_ratios,
    replay_single_tier,
    split_events,
    spread_ties,
)
from training.train import fit_policy_on_events


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "lightgbm"
    horizon_ms = int(sys.argv[2]) if len(sys.argv) > 2 else 60_000
    trace = shared_trace_path()
    if trace is None:
        sys.exit(
            "the shared trace is missing: put it in ../shared/traces or set KVWARM_SHARED_TRACE"
        )
    events = spread_ties(list(read_trace(trace)))
    train, test = split_events(events, 0.6)
    t = time.time()
    pol = fit_policy_on_events(model, train, quick=False, horizon_ms=horizon_ms)
    print("train", round(time.time() - t, 1))
    pol.observe_many(train)
    d = distinct_blocks(test)
    for frac in (0.01, 0.05, 0.1):
        cap = int(frac * d)
        r = replay_single_tier(copy.deepcopy(pol), test, cap)
        ref = reference_hit_ratios(test, cap)
        print(
            frac,
            round(r.hit_ratio, 4),
            "lru",
            round(ref["lru_exact"], 4),
            "belady",
            round(ref["belady"], 4),
            "gap closed",
            round(gap_closed(r.hit_ratio, ref["lru_exact"], ref["belady"]), 3),
            flush=True,
        )


if __name__ == "__main__":
    main()
