from __future__ import annotations

from collections import Counter

import pytest

from features.decoders import read_trace
from predictor.registry import make_policy
from serving.loop import Sidecar
from serving.placement import Placement
from serving.planner import Planner, PlannerParams
from serving.sources import FileSource


def _sidecar(policy_name: str = "lru", caps=(200, 800)) -> Sidecar:
    placement = Placement(["hbm", "dram"][: len(caps)], list(caps))
    return Sidecar(
        make_policy(policy_name), Planner(PlannerParams(min_residency_ms=5_000)), placement
    )


def test_loop_over_a_file_source_holds_capacities_and_counts(small_trace):
    sidecar = _sidecar()
    seen: list[int] = []
    sidecar.hooks.append(lambda event, moves, now: seen.append(len(moves)))
    source = FileSource(small_trace)
    stats = sidecar.run(source, batch_size=100)
    assert stats.requests == 3000 == source.stats()["events"]
    assert stats.block_accesses == sum(len(e.block_hashes) for e in read_trace(small_trace))
    assert sidecar.placement.count(0) <= 200 and sidecar.placement.count(1) <= 800
    assert sum(seen) == sum(stats.moves_by_kind.values())
    assert stats.moves_by_kind["store"] > 0 and stats.moves_by_kind["demote"] > 0


def test_hysteresis_bounds_ping_pong(small_trace):
    sidecar = _sidecar()
    moves_per_block: Counter[int] = Counter()
    speculative: Counter[int] = Counter()

    def count(event, moves, now):
        for m in moves:
            moves_per_block[m.block] += 1
            if m.kind == "prefetch":
                speculative[m.block] += 1

    sidecar.hooks.append(count)
    sidecar.run(FileSource(small_trace))
    # Hysteresis: a block is not speculatively promoted again within min_residency_ms of
    # its last move, so no block bounces at the rate of the prefetch rounds.
    events = list(read_trace(small_trace))
    span_s = (events[-1].ts_ms - events[0].ts_ms) / 1000
    assert max(speculative.values(), default=0) <= span_s / 5 + 1


def test_commit_happens_only_after_moves_are_handed_over(small_trace):
    order: list[str] = []

    class RecordingSource(FileSource):
        def commit(self) -> None:
            order.append("commit")

    sidecar = _sidecar()
    sidecar.hooks.append(lambda event, moves, now: order.append("moves"))
    sidecar.run(RecordingSource(small_trace), batch_size=500, flush=lambda: order.append("flush"))
    assert order.count("commit") == 6
    # Every commit is preceded by a flush, and the first commit comes after moves.
    assert all(order[i - 1] == "flush" for i, x in enumerate(order) if x == "commit")
    assert order.index("moves") < order.index("commit")


def test_serving_refuses_the_oracle():
    from predictor.oracle import FutureAccesses

    oracle = make_policy("oracle", future=FutureAccesses.from_events([]))
    with pytest.raises(ValueError, match="needs future knowledge"):
        Sidecar(oracle, Planner(), Placement(["hbm"], [10]))
    # A replay declares that it may run it.
    assert Sidecar(oracle, Planner(), Placement(["hbm"], [10]), allow_future=True).policy is oracle
