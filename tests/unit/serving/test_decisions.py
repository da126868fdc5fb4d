from __future__ import annotations

import json

import pytest

from executor.decision import Decision
from executor.sim import SimulatedExecutor
from features.decoders import read_trace
from predictor.registry import make_policy
from serving.decisions import (
    DecisionMaker,
    ExecutorSink,
    FanOutSink,
    JsonlDecisionSink,
    decision_id,
)
from serving.loop import Sidecar
from serving.placement import NOWHERE, Placement
from serving.planner import Move, Planner, PlannerParams
from serving.sources import FileSource

TIERS = ["hbm", "dram", "nvme"]


class ListSink:
    def __init__(self) -> None:
        self.decisions: list[Decision] = []
        self.flushes = 0

    def emit(self, decisions):
        self.decisions.extend(decisions)
        return len(decisions)

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        pass


def _run(trace, sink, num_events=None, caps=(64, 256, 4096)):
    placement = Placement(TIERS, list(caps))
    sidecar = Sidecar(make_policy("lru"), Planner(PlannerParams()), placement)
    maker = DecisionMaker(TIERS, sink, lambda: ("lru", "builtin"), deadline_ms=1_000)
    sidecar.hooks.append(maker)
    sidecar.run(FileSource(trace), max_events=num_events, batch_size=50)
    return maker


def test_moves_become_decisions_with_tier_names_and_deadline():
    sink = ListSink()
    stored: list[tuple[int, str, int]] = []
    maker = DecisionMaker(
        TIERS, sink, lambda: ("lightgbm", "3"), deadline_ms=500,
        on_store=lambda b, t, now: stored.append((b, t, now)),
    )  # fmt: skip
    moves = [
        Move(1, NOWHERE, 0, 0.0, "store"),
        Move(2, 2, 0, 0.0, "demand"),
        Move(3, 0, 1, 0.1, "demote"),
        Move(1, 0, 1, 0.05, "bypass"),
        Move(4, 2, NOWHERE, 0.01, "evict"),
        Move(5, 1, 0, 0.9, "prefetch"),
    ]
    out = maker.make("req-1", moves, now_ms=1_000)
    assert stored == [(1, "hbm", 1_000)]  # the engine computes it: no decision
    assert [(d.block_hash, d.action, d.from_tier, d.to_tier) for d in out] == [
        (2, "promote", "nvme", "hbm"),
        (3, "demote", "hbm", "dram"),
        (1, "demote", "hbm", "dram"),
        (4, "evict", "nvme", None),
        (5, "promote", "dram", "hbm"),
    ]
    assert {(d.policy, d.model_version, d.ts_ms, d.deadline_ms) for d in out} == {
        ("lightgbm", "3", 1_000, 1_500)
    }
    assert out[-1].score == pytest.approx(0.9)
    assert maker.by_action_tier == {
        ("promote", "hbm"): 2,
        ("demote", "dram"): 2,
        ("evict", "nvme"): 1,
    }


def test_ids_are_stable_across_processes_and_redelivery(small_trace):
    # Two independent sidecars fed the same events (a crash before commit, then the
    # redelivery) give the same decision ids, so the executor applies them once.
    first, second = ListSink(), ListSink()
    _run(small_trace, first, num_events=500)
    _run(small_trace, second, num_events=500)
    ids = [d.decision_id for d in first.decisions]
    assert ids and ids == [d.decision_id for d in second.decisions]
    assert len(set(ids)) == len(ids)  # and unique within a run
    assert decision_id("r", 1, "promote", "dram", "hbm") != decision_id(
        "r", 1, "promote", "nvme", "hbm"
    )


def test_jsonl_sink_round_trips_through_decision_from_dict(small_trace, tmp_path):
    path = tmp_path / "out" / "decisions.jsonl"
    sink = JsonlDecisionSink(path)
    maker = _run(small_trace, sink, num_events=300)
    sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == maker.num_decisions > 0
    decoded = [Decision.from_dict(row) for row in rows]
    assert {d.action for d in decoded} >= {"promote", "demote"}


def test_executor_sink_keeps_the_executor_in_step_with_the_planner(small_trace):
    caps = {"hbm": 64, "dram": 256, "nvme": 4096}
    executor = SimulatedExecutor(tiers=TIERS, capacity_blocks=caps)
    sink = ExecutorSink(executor)
    placement = Placement(TIERS, list(caps.values()))
    sidecar = Sidecar(make_policy("lru"), Planner(), placement, prefetch=False)
    maker = DecisionMaker(TIERS, sink, lambda: ("lru", "builtin"), on_store=sink.place_store)
    sidecar.hooks.append(maker)
    for event in list(read_trace(small_trace))[:400]:
        sidecar.handle(event)
        for tier in TIERS:
            assert executor.used_bytes(tier) <= executor.capacity_bytes(tier)
    decided = sum(n for (action, _), n in sink.outcomes.items() if action != "store")
    applied = sum(
        n
        for (action, status), n in sink.outcomes.items()
        if action != "store" and status == "applied"
    )
    assert decided == maker.num_decisions
    # The planner is the only one choosing victims and the simulated executor applies
    # each round atomically: every decision is applied and the executor holds exactly
    # what the planner's view says (no stores refused, no self-eviction).
    assert applied == decided
    assert all(status == "applied" for _, status in sink.outcomes)
    mirror = {tier: set(placement.members(i)) for i, tier in enumerate(TIERS)}
    for tier, blocks in mirror.items():
        assert set(executor.blocks_in(tier)) == blocks


def test_executor_sink_skips_a_redelivered_decision():
    executor = SimulatedExecutor(tiers=["hbm", "dram"], capacity_blocks={"hbm": 4, "dram": 8})
    sink = ExecutorSink(executor)
    sink.place_store(7, "dram", 0)
    decision = Decision(
        decision_id("req", 7, "promote", "dram", "hbm"), 0, 7, "promote", "dram", "hbm"
    )
    sink.emit([decision])
    sink.emit([decision])
    assert sink.outcomes == {
        ("store", "applied"): 1,
        ("promote", "applied"): 1,
        ("promote", "skipped"): 1,
    }
    assert sink.skip_reasons == {"duplicate decision id": 1}
    assert executor.where(7) == "hbm"


def test_fan_out_reaches_every_sink_even_when_one_fails():
    class Failing(ListSink):
        def flush(self) -> None:
            raise RuntimeError("broker gone")

    good_before, bad, good_after = ListSink(), Failing(), ListSink()
    fan = FanOutSink([good_before, bad, good_after])
    d = Decision("x", 0, 1, "evict", "hbm")
    fan.emit([d])
    with pytest.raises(RuntimeError, match="broker gone"):
        fan.flush()
    assert good_before.decisions == good_after.decisions == [d]
    assert good_before.flushes == good_after.flushes == 1
