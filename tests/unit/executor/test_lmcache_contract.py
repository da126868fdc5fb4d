"""The parts of the ``Executor`` contract (tests/unit/executor/test_executor_contract.py)
that apply to an executor over LMCache, run against the LMCache stand-in.

What does not apply, and why: LMCache holds no ``hbm`` tier (the GPU is vLLM's own),
kvwarm cannot store KV into it (``store`` is refused: the engine writes), and LMCache
evicts under its own quota, so capacities are LMCache's declared bytes, not blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from devtools.lmcache_standin import LMCacheStandIn
from executor.adapters.lmcache import LMCacheExecutor, LMCacheParams
from executor.decision import Decision
from features.block_hash import HashParams, request_blocks_accessed

OUTCOME_STATUSES = (  # executor.protocol's closed vocabulary
    "applied", "duplicate", "missing", "stale", "refused_full", "refused_pinned",
    "refused_budget", "expired", "failed",
)  # fmt: skip


def size(space: object) -> int:
    return space.size_bytes if hasattr(space, "size_bytes") else space["size_bytes"]  # type: ignore[index,attr-defined]


CHUNK = 32
TOKENS = list(range(4 * CHUNK))


@pytest.fixture
def setup() -> Iterator[tuple[LMCacheExecutor, LMCacheStandIn, list[int]]]:
    with LMCacheStandIn(chunk_size=CHUNK) as lmcache:
        ex = LMCacheExecutor(LMCacheParams(lmcache.url, "mp-0", "m", chunk_size_tokens=CHUNK))
        event = request_blocks_accessed(TOKENS, HashParams(), request_id="r", ts_ms=0)
        assert event.token_ids is not None
        ex.tokens.record(event.block_hashes, event.token_ids, event.block_size_tokens)
        lmcache.l2.update(lmcache.keys(TOKENS))
        yield ex, lmcache, list(event.block_hashes)
        ex.close()


def decide(
    did: str, block: int, action: str, src: str | None = None, to: str | None = None
) -> Decision:
    return Decision(did, int(time.time() * 1000), block, action, src, to)  # type: ignore[arg-type]


def test_has_the_protocol_methods(setup) -> None:
    ex, lmcache, _ = setup
    for method in ("apply", "locate", "capacities", "occupancy", "health", "close", "store"):
        assert callable(getattr(ex, method))
    caps = ex.capacities()
    assert set(caps) == set(ex.tier_names) == {"dram", "nvme"}
    assert size(caps["dram"]) == lmcache.capacity_bytes["l1"]


def test_a_decision_id_is_applied_once(setup) -> None:
    ex, lmcache, blocks = setup
    promote = decide("p", blocks[0], "promote", "nvme", "dram")
    demote = decide("d", blocks[0], "demote", "dram", "nvme")
    assert [o.status for o in ex.apply([promote, demote])] == ["applied", "applied"]
    assert [o.status for o in ex.apply([promote, demote])] == ["duplicate", "duplicate"]
    assert ex.locate(blocks[0]) == "nvme"


def test_locate_follows_promote_demote_and_evict(setup) -> None:
    ex, _, blocks = setup
    b = blocks[3]
    assert ex.locate(b) == "nvme"
    assert ex.apply([decide("1", b, "promote", "nvme", "dram")])[0].status == "applied"
    assert ex.locate(b) == "dram"
    assert ex.apply([decide("2", b, "demote", "dram", "nvme")])[0].status == "applied"
    assert ex.locate(b) == "nvme"
    assert ex.apply([decide("3", b, "evict", "nvme")])[0].status == "applied"
    assert ex.locate(b) is None


def test_stale_and_missing_decisions_change_nothing(setup) -> None:
    ex, lmcache, blocks = setup
    before = (set(lmcache.l1), set(lmcache.l2))
    outcomes = ex.apply(
        [
            decide("m", 424242, "promote", "nvme", "dram"),
            decide("s", blocks[0], "demote", "hbm", "dram"),
        ]
    )
    assert [o.status for o in outcomes] == ["missing", "stale"]
    assert (set(lmcache.l1), set(lmcache.l2)) == before


def test_a_batch_applies_in_order_and_outcomes_align(setup) -> None:
    ex, lmcache, blocks = setup
    batch = [
        decide("a", blocks[0], "promote", "nvme", "dram"),
        decide("b", blocks[0], "demote", "dram", "nvme"),
        decide("c", blocks[6], "evict", None),
    ]
    outcomes = ex.apply(batch)
    assert [o.decision_id for o in outcomes] == ["a", "b", "c"]
    assert {o.status for o in outcomes} <= set(OUTCOME_STATUSES)
    # Only block 6's chunk went: its ancestors' chunks (block 0's among them) stay.
    assert ex.locate(blocks[6]) is None and ex.locate(blocks[0]) == "nvme"
    assert ex.locate(blocks[2]) == "nvme"
    occupancy, caps = ex.occupancy(), ex.capacities()
    assert all(size(occupancy[t]) <= size(caps[t]) for t in ex.tier_names)


def test_store_is_refused_and_health_reports(setup) -> None:
    ex, _, blocks = setup
    assert ex.store(blocks[0], "dram", 1).status == "failed"
    ex.apply([decide("h", blocks[0], "promote", "nvme", "dram")])
    health = ex.health()
    assert health["status"] == "ok" and health["tiers"] == ["dram", "nvme"]
    assert health["num_decisions"]["applied"] == 1
