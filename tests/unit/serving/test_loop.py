from __future__ import annotations

import time
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


def test_the_loops_time_is_split_by_phase(small_trace):
    class SlowCommitSource(FileSource):
        def commit(self) -> None:
            time.sleep(0.002)

    sidecar = _sidecar()
    t0 = time.perf_counter()
    stats = sidecar.run(
        SlowCommitSource(small_trace), batch_size=500, flush=lambda: time.sleep(0.001)
    )
    elapsed = time.perf_counter() - t0
    phase = stats.seconds_by_phase
    assert stats.batches == 6  # 3,000 events in polls of 500
    assert phase["commit"] >= 6 * 0.002 and phase["deliver"] >= 6 * 0.001
    assert phase["handle"] > phase["deliver"] and phase["poll"] > 0
    assert sum(phase.values()) <= elapsed


def test_serving_refuses_the_oracle():
    from predictor.oracle import FutureAccesses

    oracle = make_policy("oracle", future=FutureAccesses.from_events([]))
    with pytest.raises(ValueError, match="needs future knowledge"):
        Sidecar(oracle, Planner(), Placement(["hbm"], [10]))
    # A replay declares that it may run it.
    assert Sidecar(oracle, Planner(), Placement(["hbm"], [10]), allow_future=True).policy is oracle


def _prefetching(split: bool) -> Sidecar:
    placement = Placement(["hbm", "dram", "nvme"], [100, 400, 4_000])
    # LFU: under exact LRU eviction the fastest tiers already hold the most recent
    # blocks, so an LRU-scored prefetch round has nothing to promote.
    return Sidecar(
        make_policy("lfu"),
        Planner(PlannerParams(min_residency_ms=0)),
        placement,
        prefetch_min_precision=None,
        prefetch_split=split,
    )


def test_a_split_prefetch_round_runs_one_step_per_event(small_trace):
    sidecar = _prefetching(split=True)
    steps: list[list[str]] = []
    policy, planner = sidecar.policy, sidecar.planner
    name_candidates, fill = policy.prefetch_candidates, planner.prefetch

    def named(*args):
        steps[-1].append("candidates")
        return name_candidates(*args)

    def filled(*args):
        steps[-1].append("fill")
        return fill(*args)

    policy.prefetch_candidates = named  # type: ignore[method-assign]
    planner.prefetch = filled  # type: ignore[method-assign]
    for event in list(read_trace(small_trace))[:600]:
        steps.append([])
        sidecar.handle(event)
    assert all(len(s) <= 1 for s in steps)
    # C: candidates named, _: scored (or nothing), F: a tier filled. A round is C_FF
    # (one fill per target tier), or C alone when it found no candidates.
    trail = "".join({"candidates": "C", "fill": "F"}[s[0]] if s else "_" for s in steps)
    trail = trail[: trail.rfind("C")]  # the last round may still be under way
    assert trail.count("C_FF") > 10
    assert "F" not in trail.replace("C_FF", "")
    assert sidecar.stats.moves_by_kind.get("prefetch", 0) > 0


def test_split_round_steps_back_to_back_make_the_inline_rounds_moves(small_trace):
    inline, split = _prefetching(split=False), _prefetching(split=True)
    events = list(read_trace(small_trace))[:400]
    for sidecar in (inline, split):
        sidecar.prefetch_enabled = False
        for event in events:
            sidecar.handle(event)
        sidecar.prefetch_enabled = True
    now_ms = events[-1].ts_ms
    expected = inline.maybe_prefetch(now_ms)
    got = split.maybe_prefetch(now_ms)
    assert split._round is not None and not got  # the first step names candidates only
    while split._round is not None:
        got += split.maybe_prefetch(now_ms)
    assert expected and got == expected
    assert [split.placement.tier_of(m.block) for m in got] == [
        inline.placement.tier_of(m.block) for m in expected
    ]
    assert inline.maybe_prefetch(now_ms) == []  # the interval has not passed
    split.drop_round()
    assert split._round is None
