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
            make_policy("lfu"),  # LRU has nothing to prefetch: exact recency eviction
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


def test_each_target_tier_is_gated_on_its_own_precision():
    gate = PrefetchGate(0.25, window=50, probe_every=5, prior_outcomes=1)
    for b in range(100):  # prefetches into HBM (0) all leave unread ...
        gate.on_moves([_prefetch(b, to_tier=0)])
        gate.on_moves([_demote(b, from_tier=0)])
    for b in range(1_000, 1_100):  # ... those into DRAM (1) are all read
        gate.on_moves([_prefetch(b, to_tier=1)])
        gate.on_request([b])
    assert gate.precision_of(0) < 0.05 and gate.precision_of(1) > 0.95
    hbm = [gate.allow_round(0) for _ in range(20)]
    dram = [gate.allow_round(1) for _ in range(20)]
    assert sum(hbm) == 4 and all(dram)  # HBM probes one round in five, DRAM runs
    assert gate.status()["precision_by_tier"] == {"0": round(gate.precision_of(0), 4), "1": 1.0}


def test_the_fastest_tier_takes_only_predicted_blocks_when_the_policy_predicts():
    import numpy as np

    from features.events import BlocksAccessed
    from predictor.baselines import LRUPolicy
    from serving.loop import Sidecar
    from serving.placement import Placement
    from serving.planner import Planner

    class Ranked(LRUPolicy):
        """Blocks 7 and 8 score highest; the rest by id, reversed after 1 s (so the
        blocks evicted first outscore the residents later)."""

        predicts = True

        def score(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
            ids = np.asarray(block_hashes, dtype=np.float64)
            rest = ids if now_ms < 1_000 else 100.0 - ids
            return np.where(ids >= 7, 1_000.0, rest).astype(np.float32)

        def prefetch_candidates(self, now_ms: int, limit: int) -> np.ndarray:
            blocks = [7, 8] if self.predicts else []
            return np.array(blocks, dtype=np.uint64)

    def run(policy):
        placement = Placement(["hbm", "dram"], [4, 64])
        sidecar = Sidecar(policy, Planner(), placement, prefetch_min_precision=None)
        for i, blocks in enumerate([(1, 2), (3, 4), (5, 6)]):  # recent ones, some demoted
            sidecar.handle(BlocksAccessed(10 + i, f"r{i}", blocks, 16))
        for b in (7, 8):  # blocks of an older request, predicted back, in DRAM
            placement.add(b, 1, 0)
        moved = []
        sidecar.hooks.append(lambda e, moves, now: moved.extend(moves))
        sidecar.maybe_prefetch(100_000)
        return {m.block for m in moved if m.kind == "prefetch" and m.to_tier == 0}

    silent = Ranked()
    silent.predicts = False
    # HBM keeps 3 to 6; 1 and 2 (recent) and 7 and 8 (predicted) wait in DRAM.
    assert run(Ranked()) == {7, 8}
    assert run(silent) == {1, 2}  # no prediction: recent blocks climb back
