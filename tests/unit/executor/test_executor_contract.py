"""The ``executor.protocol.Executor`` contract, run over every implementation.

To add an implementation (an adapter to a real cache layer), add a factory to
``IMPLEMENTATIONS``: it builds the executor with tiers hbm, dram, nvme holding
``CAPACITY_BLOCKS`` blocks of ``block_bytes`` each, and returns it with ``block_bytes``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from itertools import count
from pathlib import Path

import pytest

from executor.decision import Decision
from executor.protocol import OUTCOME_STATUSES, Executor
from executor.sim import SimulatedExecutor, load_profile

TIERS = ("hbm", "dram", "nvme")
CAPACITY_BLOCKS = {"hbm": 2, "dram": 4, "nvme": 16}


def _local(tmp_path: Path, disk_kind: str = "directory") -> tuple[Executor, int]:
    from executor.core import Executor as LocalExecutor
    from executor.core import ExecutorParams
    from executor.tiers import make_tier
    from executor.tiers.memory import MemoryTier, MemoryTierParams

    block_bytes = 1024
    nvme = {"capacity_bytes": CAPACITY_BLOCKS["nvme"] * block_bytes, "root": str(tmp_path / "nvme")}
    tiers = [
        MemoryTier("hbm", MemoryTierParams(capacity_bytes=CAPACITY_BLOCKS["hbm"] * block_bytes)),
        MemoryTier("dram", MemoryTierParams(capacity_bytes=CAPACITY_BLOCKS["dram"] * block_bytes)),
        make_tier(disk_kind, "nvme", {**nvme, "fsync": False}),
    ]
    params = ExecutorParams(state_dir=tmp_path / "state", fsync_journal=False)
    return LocalExecutor(tiers, params), block_bytes


def _simulated(tmp_path: Path) -> tuple[Executor, int]:
    profile = load_profile()
    for tier in TIERS:  # no prefetch budget: these tests are about placement
        profile = profile.with_tier(tier, prefetch_share=1.0)
    sim = SimulatedExecutor(profile, tiers=TIERS, capacity_blocks=CAPACITY_BLOCKS)
    return sim, sim.block_bytes


IMPLEMENTATIONS: dict[str, Callable[[Path], tuple[Executor, int]]] = {
    "local": _local,
    "local-slab": lambda tmp_path: _local(tmp_path, "slab"),
    "simulated": _simulated,
}


class Harness:
    def __init__(self, executor: Executor, block_bytes: int) -> None:
        self.ex = executor
        self.block_bytes = block_bytes
        self._ids = count()

    def store(self, block: int, tier: str) -> str:
        return self.ex.store(block, tier, self.block_bytes).status

    def decide(
        self, block: int, action: str, to: str | None = None, src: str | None = None
    ) -> Decision:
        return Decision(f"c{next(self._ids)}", 1, block, action, src, to)  # type: ignore[arg-type]

    def one(self, decision: Decision) -> str:
        (outcome,) = self.ex.apply([decision])
        return outcome.status

    def where(self, blocks: range | list[int]) -> list[str | None]:
        return [self.ex.locate(b) for b in blocks]


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def h(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    executor, block_bytes = IMPLEMENTATIONS[request.param](tmp_path)
    yield Harness(executor, block_bytes)
    executor.close()


def test_implements_the_protocol(h: Harness) -> None:
    assert isinstance(h.ex, Executor)
    assert list(h.ex.tier_names) == list(TIERS)
    caps = h.ex.capacities()
    assert {t: caps[t].size_bytes for t in TIERS} == {
        t: n * h.block_bytes for t, n in CAPACITY_BLOCKS.items()
    }
    assert all(caps[t].num_blocks in (None, CAPACITY_BLOCKS[t]) for t in TIERS)


def test_a_decision_id_is_applied_once(h: Harness) -> None:
    assert h.store(1, "nvme") == "applied"
    promote = h.decide(1, "promote", "dram")
    assert h.one(promote) == "applied"
    demote = h.decide(1, "demote", "nvme")
    assert h.one(demote) == "applied"
    # Redelivered (a crash before the offset commit): neither moves the block again.
    assert [o.status for o in h.ex.apply([promote, demote])] == ["duplicate", "duplicate"]
    assert h.ex.locate(1) == "nvme"


def test_a_full_tier_refuses_and_nothing_changes(h: Harness) -> None:
    for block in (1, 2):
        assert h.store(block, "hbm") == "applied"
    assert h.store(3, "dram") == "applied"
    before = (h.where([1, 2, 3]), h.ex.occupancy())
    assert h.one(h.decide(3, "promote", "hbm")) == "refused_full"
    assert h.store(4, "hbm") == "refused_full"
    assert (h.where([1, 2, 3]), h.ex.occupancy()) == before
    assert h.ex.locate(4) is None


def test_locate_follows_promote_demote_and_evict(h: Harness) -> None:
    assert h.ex.locate(7) is None
    assert h.store(7, "nvme") == "applied" and h.ex.locate(7) == "nvme"
    assert h.one(h.decide(7, "promote", "hbm", src="nvme")) == "applied"
    assert h.ex.locate(7) == "hbm"
    assert h.one(h.decide(7, "demote", "dram")) == "applied" and h.ex.locate(7) == "dram"
    assert h.one(h.decide(7, "evict", src="dram")) == "applied" and h.ex.locate(7) is None


def test_stale_and_missing_decisions_change_nothing(h: Harness) -> None:
    assert h.one(h.decide(9, "promote", "hbm")) == "missing"
    assert h.store(9, "dram") == "applied"
    assert h.one(h.decide(9, "promote", "hbm", src="nvme")) == "stale"  # it is in dram
    assert h.one(h.decide(9, "demote", "dram")) == "stale"  # already there
    assert h.one(h.decide(9, "evict", src="hbm")) == "stale"
    assert h.ex.locate(9) == "dram"


def test_a_batch_applies_in_order(h: Harness) -> None:
    for block in (1, 2):
        h.store(block, "hbm")
    h.store(3, "dram")
    # The planner's demote makes the room its promote needs: in that order, both apply.
    demote, promote = h.decide(1, "demote", "dram"), h.decide(3, "promote", "hbm")
    outcomes = h.ex.apply([demote, promote])
    assert [(o.decision_id, o.status) for o in outcomes] == [
        (demote.decision_id, "applied"),
        (promote.decision_id, "applied"),
    ]
    assert h.where([1, 2, 3]) == ["dram", "hbm", "hbm"]
    # The other way round the promote finds hbm full.
    demote, promote = h.decide(2, "demote", "dram"), h.decide(1, "promote", "hbm")
    assert [o.status for o in h.ex.apply([promote, demote])] == ["refused_full", "applied"]
    assert h.where([1, 2, 3]) == ["dram", "dram", "hbm"]


def test_occupancy_stays_within_capacity_and_matches_locate(h: Harness) -> None:
    rng = random.Random(3)
    blocks = list(range(40))
    for _ in range(60):
        batch = []
        for _ in range(rng.randint(1, 6)):
            block = rng.choice(blocks)
            where = h.ex.locate(block)
            if where is None:
                h.store(block, rng.choice(TIERS))
                continue
            action = rng.choice(["promote", "demote", "evict"])
            to = None if action == "evict" else rng.choice([t for t in TIERS if t != where])
            batch.append(h.decide(block, action, to))
        outcomes = h.ex.apply(batch)
        assert [o.decision_id for o in outcomes] == [d.decision_id for d in batch]
        assert {o.status for o in outcomes} <= set(OUTCOME_STATUSES)
        occupancy, capacities = h.ex.occupancy(), h.ex.capacities()
        located = h.where(blocks)
        for tier in TIERS:
            assert occupancy[tier].size_bytes <= capacities[tier].size_bytes
            assert occupancy[tier].num_blocks == located.count(tier)


def test_health_reports_status_tiers_and_decisions(h: Harness) -> None:
    h.store(1, "dram")
    h.one(h.decide(1, "promote", "hbm"))
    health = h.ex.health()
    assert health["status"] == "ok" and health["tiers"] == list(TIERS)
    assert isinstance(health["num_decisions"], dict) and health["num_decisions"]["applied"] == 1
