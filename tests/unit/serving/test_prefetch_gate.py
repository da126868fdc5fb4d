"""The prefetch gate: speculative prefetch runs only while it pays."""

from __future__ import annotations

import pytest

from serving.planner import Move
from serving.prefetch_gate import PrefetchGate


def _prefetch(block: int, to_tier: int = 0) -> Move:
    return Move(block, 2, to_tier, 1.0, "prefetch")


def _demote(block: int, from_tier: int = 0) -> Move:
    return Move(block, from_tier, from_tier + 1, 0.0, "demote")


def test_wasted_prefetches_close_the_gate_and_probes_keep_measuring():
    gate = PrefetchGate(0.25, window=50, probe_every=5, prior_outcomes=5)
    assert gate.open and gate.allow_round()
    for b in range(100):  # every prefetch is moved out of its tier before any read
        gate.on_moves([_prefetch(b)])
        gate.on_moves([_demote(b)])
    assert gate.precision < 0.05 and not gate.open
    ran = [gate.allow_round() for _ in range(20)]
    assert sum(ran) == 4  # one round in five probes
    assert gate.num_wasted == 100 and gate.num_used == 0


def test_used_prefetches_reopen_it():
    gate = PrefetchGate(0.25, window=50, prior_outcomes=0.0001)
    for b in range(40):
        gate.on_moves([_prefetch(b)])
        gate.on_moves([_demote(b)])
    assert not gate.open
    for b in range(100, 200):  # now every prefetched block is read
        gate.on_moves([_prefetch(b)])
        gate.on_request([b, b + 10_000])
    assert gate.open and gate.precision > 0.5
    assert gate.num_used == 100


def test_a_move_from_another_tier_does_not_resolve_and_pending_is_bounded():
    gate = PrefetchGate(0.25, max_pending=10)
    gate.on_moves([_prefetch(1, to_tier=0)])
    gate.on_moves([_demote(1, from_tier=1)])  # not from the tier it was prefetched into
    assert 1 in gate.pending and gate.num_wasted == 0
    gate.on_moves([_prefetch(b) for b in range(2, 30)])
    assert len(gate.pending) == 10 and 1 not in gate.pending


def test_min_precision_out_of_range_is_refused():
    with pytest.raises(ValueError, match="min_precision"):
        PrefetchGate(1.5)


def test_the_sidecar_skips_rounds_while_the_gate_is_closed(small_trace):
    from features.decoders import read_trace
    from predictor.registry import make_policy
    from serving.loop import Sidecar
    from serving.placement import Placement
    from serving.planner import Planner

    def run(min_precision):
        sidecar = Sidecar(
            make_policy("lru"),
            Planner(),
            Placement(["hbm", "dram", "nvme"], [32, 128, 4096]),
            prefetch_interval_ms=100,
            prefetch_min_precision=min_precision,
        )
        for i, event in enumerate(read_trace(small_trace)):
            if i >= 800:
                break
            sidecar.handle(event)
        return sidecar

    ungated, strict = run(None), run(1.0)  # 1.0: closed after the first waste
    assert ungated.prefetch_gate is None
    assert strict.prefetch_gate is not None and strict.prefetch_gate.num_skipped > 0
    kinds_strict, kinds_free = strict.stats.moves_by_kind, ungated.stats.moves_by_kind
    assert kinds_strict.get("prefetch", 0) < kinds_free.get("prefetch", 0)
