"""One stream of truth per engine: a vLLM-protocol publisher's residency events and
requests posted to ``POST /v1/requests`` meet in the sidecar by (engine, block hash).

The engine side publishes the block ids vLLM 0.33.0's own code computed for these
prompts (tests/data/vllm_block_hashes/vectors.json); the router side posts only token
ids. A promote from the tier the engine reported is only possible if kvwarm hashed the
tokens into the very ids the engine published.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest

from devtools.lmcache_standin import LMCacheStandIn
from devtools.vllm_engine import TAGGED, EnginePublisher
from executor.kvhints import SCHEMA_PATH, decisions_from_record
from serving.request_intake import MAX_REQUEST_BODY_BYTES, IntakeSource, RequestIntake
from serving.serve_cli import Service
from serving.settings import load_settings

pytestmark = pytest.mark.timeout(120)

VECTORS = json.loads(
    (Path(__file__).parents[2] / "data" / "vllm_block_hashes" / "vectors.json").read_text()
)


def vllm_case(name: str) -> dict[str, Any]:
    return next(
        c
        for c in VECTORS["cases"]
        if c["name"] == name and c["hash_algo"] == "sha256" and c["pythonhashseed"] is None
    )


def post(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def wait_for(done: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return
        time.sleep(0.02)
    raise TimeoutError("condition not met")


@pytest.fixture
def publisher() -> Iterator[EnginePublisher]:
    with EnginePublisher() as pub:
        yield pub


def stored_batch(hashes: list[int], tokens: list[int], medium: str) -> Any:
    event = TAGGED.BlockStored(  # type: ignore[call-arg]
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens,
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )
    return TAGGED.KVEventBatch(ts=time.time(), events=[event], data_parallel_rank=0)


def test_engine_residency_and_posted_requests_join_into_decisions(
    publisher: EnginePublisher, tmp_path: Path
) -> None:
    offloaded = vllm_case("plain-16")  # the engine offloaded this prompt's blocks to CPU
    fresh = vllm_case("salt")  # never computed: the engine will store it itself
    decisions_path = tmp_path / "hints.jsonl"
    settings = load_settings(
        None,
        source=publisher.url("vllm-0"),
        executor="none",
        decisions=(f"file:{decisions_path}",),
        decisions_format="kvhints",
        engine_id="vllm-0",
        http_port=0,
        model_poll_interval_s=0,
        prefetch=False,
        poll_timeout_ms=20,
    )
    service = Service(settings).start()
    runner = threading.Thread(target=service.run, daemon=True)
    runner.start()
    try:
        assert service.http is not None
        url = service.http.url + "/v1/requests"

        def engine_seen() -> bool:
            return service.source.stats()["engines"]["vllm-0"]["last_seq"] is not None

        publisher.heartbeat_until(engine_seen, timeout_s=10)
        publisher.publish(stored_batch(offloaded["event_ids"], offloaded["tokens"][:32], "CPU"))
        wait_for(lambda: len(service.placement) == len(offloaded["event_ids"]))

        code, reply = post(
            url,
            json.dumps(
                {"engine_id": "vllm-0", "request_id": "r1", "token_ids": offloaded["tokens"]}
            ).encode(),
        )
        assert code == 202, reply
        assert reply["block_hashes"] == offloaded["event_ids"]
        code, reply = post(
            url,
            json.dumps(
                {"token_ids": fresh["tokens"], "cache_salt": "tenant-a", "request_id": "r2"}
            ).encode(),
        )
        assert code == 202 and reply["block_hashes"] == fresh["event_ids"]
        # Another engine's request is dropped, not mixed into this engine's view.
        code, _ = post(url, json.dumps({"engine_id": "vllm-1", "token_ids": [1] * 64}).encode())
        assert code == 202
        wait_for(lambda: service.sidecar.stats.requests == 2 and decisions_path.exists())
        wait_for(lambda: service.source.stats()["events_other_engine"] == 1)
        service.sink.flush()
    finally:
        service.stop()
        runner.join(timeout=10)
        service.close()

    schema = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))
    lines = decisions_path.read_bytes().splitlines()
    for line in lines:
        schema.validate(json.loads(line))
    decisions = [d for line in lines for d in decisions_from_record(line)]
    promoted = {d.block_hash for d in decisions if d.action == "promote"}
    # The engine's CPU blocks are promoted to HBM for the request that reads them ...
    assert promoted == set(offloaded["event_ids"])
    assert all(
        (d.from_tier, d.to_tier) == ("dram", "hbm") for d in decisions if d.action == "promote"
    )
    # ... and the fresh prompt's blocks are stored by the engine itself (no decision).
    assert not {d.block_hash for d in decisions} & set(fresh["event_ids"])
    for i in range(service.placement.num_tiers):
        members = set(service.placement.members(i))
        if service.placement.tier_names[i] == "hbm":
            assert set(offloaded["event_ids"]) | set(fresh["event_ids"]) <= members


def test_request_endpoint_refuses_bad_input_with_a_reason_and_bounds_everything() -> None:
    intake = RequestIntake(max_pending=1)
    code, reply = intake.submit(b'{"token_ids": [1, "x"]}')
    assert code == 400 and "token_ids" in reply["error"] and reply["reason"] == "bad_token"
    code, reply = intake.submit(b'{"token_ids": [1], "hash_algo": "builtin"}')
    assert code == 400 and "--prefix-caching-hash-algo sha256" in reply["error"]
    code, reply = intake.submit(b'{"token_ids": [1], "cache_salt ": "typo"}')
    assert code == 400 and reply["reason"] == "unknown_field"
    code, reply = intake.submit(b"{not json")
    assert code == 400 and reply["reason"] == "bad_json"
    assert intake.submit(b'{"token_ids": [1, 2]}')[0] == 202
    code, reply = intake.submit(b'{"token_ids": [1, 2]}')
    assert code == 503 and reply["reason"] == "queue_full"
    source = IntakeSource(intake)
    (event,) = source.poll(10, 0)
    assert event.block_hashes == () and event.token_ids == (1, 2)
    stats = source.stats()
    assert stats["rejects_by_reason"]["request_bad_token"] == 1
    assert stats["requests_queue_full"] == 1


def test_http_bounds_the_body(publisher: EnginePublisher) -> None:
    settings = load_settings(
        None, source=publisher.url(), executor="none", http_port=0, model_poll_interval_s=0
    )
    service = Service(settings).start()
    try:
        assert service.http is not None
        url = service.http.url + "/v1/requests"
        request = urllib.request.Request(
            url,
            data=b"x",
            method="POST",
            headers={"Content-Length": str(MAX_REQUEST_BODY_BYTES + 1)},
        )
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=10)
        assert info.value.code == 413
        code, reply = post(service.http.url + "/v1/nothing", b"{}")
        assert code == 404 and "/v1/requests" in reply["error"]
    finally:
        service.close()


def test_an_engine_id_the_zmq_source_does_not_name_fails_at_start(
    publisher: EnginePublisher,
) -> None:
    settings = load_settings(
        None, source=publisher.url(), executor="none", engine_id="vllm-0", http_enabled=False
    )
    with pytest.raises(click.UsageError, match="add engine=vllm-0 to the zmq:// URL"):
        Service(settings)


def test_decisions_reach_lmcache_as_token_prefixes(publisher: EnginePublisher) -> None:
    """--executor lmcache:...: the engine's CPU blocks, read by a posted request, are
    prefetched in LMCache by the request's own tokens."""
    offloaded = vllm_case("plain-16")  # 40 tokens: two 16-token blocks
    with LMCacheStandIn(chunk_size=16) as lmcache:
        settings = load_settings(
            None,
            source=publisher.url("vllm-0"),
            executor=f"lmcache:{lmcache.url}?instance=mp-0&model=qwen&chunk_size=16",
            engine_id="vllm-0",
            http_port=0,
            model_poll_interval_s=0,
            prefetch=False,
            poll_timeout_ms=20,
        )
        service = Service(settings).start()
        runner = threading.Thread(target=service.run, daemon=True)
        runner.start()
        try:
            assert service.http is not None

            def engine_seen() -> bool:
                return service.source.stats()["engines"]["vllm-0"]["last_seq"] is not None

            publisher.heartbeat_until(engine_seen, timeout_s=10)
            publisher.publish(stored_batch(offloaded["event_ids"], offloaded["tokens"][:32], "CPU"))
            wait_for(lambda: len(service.placement) == 2)
            body = {"engine_id": "vllm-0", "token_ids": offloaded["tokens"]}
            assert post(service.http.url + "/v1/requests", json.dumps(body).encode())[0] == 202
            wait_for(lambda: sum(1 for _, p, _ in lmcache.calls if p == "/cache/prefetches") == 2)
        finally:
            service.stop()
            runner.join(timeout=10)
            service.close()
    prefetched = [b["token_ids"] for _, p, b in lmcache.calls if p == "/cache/prefetches"]
    assert sorted(prefetched, key=len) == [offloaded["tokens"][:16], offloaded["tokens"][:32]]
    assert all(b["instance_id"] == "mp-0" for _, p, b in lmcache.calls if p == "/cache/prefetches")
