"""The LMCache adapter against a stand-in with LMCache 0.5.6's coordinator API shapes
(devtools/lmcache_standin.py); tests/integration/test_lmcache_coordinator.py runs the
same calls against a real LMCache coordinator where one is installed."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from devtools.lmcache_standin import LMCacheStandIn
from executor.adapters.lmcache import LMCacheExecutor, LMCacheParams, TokenIndex, params_from_url
from executor.decision import Decision
from executor.kvhints import ack_status_of
from features.block_hash import HashParams, request_blocks_accessed

CHUNK = 64
BLOCK = 16
TOKENS = list(range(1000, 1000 + 4 * CHUNK + 8))  # 4 whole chunks and a partial one


@pytest.fixture
def lmcache() -> Iterator[LMCacheStandIn]:
    with LMCacheStandIn(chunk_size=CHUNK) as standin:
        yield standin


def adapter(url: str, instance_id: str = "mp-0") -> tuple[LMCacheExecutor, list[int]]:
    ex = LMCacheExecutor(
        LMCacheParams(url, instance_id, "qwen", chunk_size_tokens=CHUNK, timeout_s=2)
    )
    event = request_blocks_accessed(TOKENS, HashParams(), request_id="r", ts_ms=0)
    assert event.token_ids is not None
    ex.tokens.record(event.block_hashes, event.token_ids, event.block_size_tokens)
    return ex, list(event.block_hashes)


def d(
    did: str, block: int, action: str, frm: str | None = None, to: str | None = None, **kw
) -> Decision:
    return Decision(did, int(time.time() * 1000), block, action, frm, to, **kw)  # type: ignore[arg-type]


def test_decisions_become_coordinator_calls_with_outcomes_in_order(lmcache: LMCacheStandIn) -> None:
    ex, blocks = adapter(lmcache.url)
    lmcache.l2.update(lmcache.keys(TOKENS))  # everything offloaded to L2 earlier
    third_chunk_block = blocks[(2 * CHUNK) // BLOCK]  # first block of chunk 3
    last_block = blocks[-1]  # in chunk 4 (block 16 ends at token 256)
    outcomes = ex.apply(
        [
            d("a", third_chunk_block, "promote", "nvme", "dram"),
            d("b", last_block, "promote", "nvme", "hbm"),
            d("c", blocks[0], "pin", "nvme"),
            d("d", blocks[0], "evict", "nvme"),
            d("e", blocks[0], "unpin"),
            d("f", blocks[0], "evict", "nvme"),
            d("a", third_chunk_block, "promote", "nvme", "dram"),
            d("g", blocks[5], "demote", "dram", "nvme"),
            d("h", 12345, "promote", "nvme", "dram"),
            d("i", blocks[1], "promote", "nvme", "dram", deadline_ms=1),
        ]
    )
    assert [o.decision_id for o in outcomes] == list("abcdefaghi")
    assert [o.status for o in outcomes] == [
        "applied", "applied", "applied", "refused_pinned", "applied", "applied",
        "duplicate", "applied", "missing", "expired",
    ]  # fmt: skip
    assert outcomes[1].reason.startswith("clipped")  # L1 warmed; vLLM loads the GPU itself
    assert [ack_status_of(o.status, o.reason) for o in outcomes[:3]] == [
        "accepted", "clipped", "accepted",
    ]  # fmt: skip
    # The prefetch named whole chunks through the block's chunk, from token 0.
    prefetches = [body for m, p, body in lmcache.calls if p == "/cache/prefetches"]
    assert [len(b["token_ids"]) for b in prefetches] == [3 * CHUNK, 4 * CHUNK]
    assert prefetches[0]["token_ids"] == TOKENS[: 3 * CHUNK]
    assert prefetches[0]["instance_id"] == "mp-0" and prefetches[0]["model_name"] == "qwen"
    # The demote dropped chunk 2's L1 copy and kept its L2 copy; the evict removed chunk 1.
    chunk2 = lmcache.keys(TOKENS)[1]
    assert chunk2 not in lmcache.l1 and chunk2 in lmcache.l2
    assert lmcache.keys(TOKENS)[0] not in lmcache.l2
    # Deletes name one chunk's keys on the MP server, never the whole prefix.
    deleted = [b["keys"] for m, p, b in lmcache.calls if p == "/cache/objects"]
    assert [len(k) for k in deleted] == [1, 1]


def test_the_adapter_never_evicts_on_its_own(lmcache: LMCacheStandIn) -> None:
    ex, blocks = adapter(lmcache.url)
    ex.apply([d(f"p{i}", b, "promote", "nvme", "dram") for i, b in enumerate(blocks)])
    assert {p for _, p, _ in lmcache.calls} == {"/cache/prefetches"}


def test_locate_capacities_occupancy_health(lmcache: LMCacheStandIn) -> None:
    ex, blocks = adapter(lmcache.url)
    keys = lmcache.keys(TOKENS)
    lmcache.l2.update(keys)
    lmcache.l1.add(keys[0])
    assert ex.locate(blocks[0]) == "dram"
    assert ex.locate(blocks[4]) == "nvme"
    assert ex.locate(999) is None
    caps, occ = ex.capacities(), ex.occupancy()
    size = lambda space: space.size_bytes if hasattr(space, "size_bytes") else space["size_bytes"]  # noqa: E731
    assert size(caps["dram"]) == lmcache.capacity_bytes["l1"]
    assert size(occ["dram"]) == lmcache.chunk_bytes and size(occ["nvme"]) == 4 * lmcache.chunk_bytes
    assert all(size(occ[t]) <= size(caps[t]) for t in ex.tier_names)
    health = ex.health()
    assert health["status"] == "ok" and health["tiers"] == ["dram", "nvme"]
    lmcache.healthy = False
    assert "503" in ex.health()["status"]


def test_coordinator_errors_are_failed_outcomes_that_a_redelivery_retries(
    lmcache: LMCacheStandIn,
) -> None:
    ex, blocks = adapter(lmcache.url, instance_id="not-registered")
    (out,) = ex.apply([d("x", blocks[0], "promote", "nvme", "dram")])
    assert out.status == "failed" and "no MP server registered" in out.reason
    down, _ = adapter("http://127.0.0.1:9")  # nothing listens on the discard port
    down.tokens = ex.tokens
    (out,) = down.apply([d("y", blocks[0], "pin")])
    assert out.status == "failed" and "unreachable" in out.reason
    ex.params = LMCacheParams(lmcache.url, "mp-0", "qwen", chunk_size_tokens=CHUNK)
    (out,) = ex.apply([d("x", blocks[0], "promote", "nvme", "dram")])
    assert out.status == "applied"  # the failed id was not remembered


def test_token_index_is_bounded() -> None:
    index = TokenIndex(max_requests=2)
    for r in range(5):
        index.record([r * 10, r * 10 + 1], list(range(32)), 16)
    assert len(index) == 4
    assert index.tokens_through(0) is None and index.tokens_through(41) == (tuple(range(32)), 32)


def test_params_from_a_url_and_bad_params_fail_with_the_fix() -> None:
    p = params_from_url("http://10.0.0.5:9300?instance=mp-1&model=qwen&world_size=2&chunk_size=128")
    assert (p.coordinator_url, p.instance_id, p.model_name) == (
        "http://10.0.0.5:9300",
        "mp-1",
        "qwen",
    )
    assert (p.world_size, p.chunk_size_tokens, p.cache_salt) == (2, 128, "")
    with pytest.raises(ValueError, match="missing model"):
        params_from_url("http://h:1?instance=a")
    with pytest.raises(ValueError, match="unknown 'modle'"):
        params_from_url("http://h:1?instance=a&model=m&modle=x")
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        LMCacheParams("localhost:9300", "mp-0", "m")
