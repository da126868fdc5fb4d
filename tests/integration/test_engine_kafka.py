"""End to end through the real Kafka broker, as a deployment next to vLLM runs:

engine (vLLM-protocol ZMQ publisher) -> bridge -> events topic <- router's request
events (token ids only) -> sidecar (``kvwarm serve``'s Service, one engine) -> hint
envelopes on the decisions topic -> an executor acknowledges on the ack topic -> the
sidecar counts the acks.

The engine publishes the block ids vLLM 0.33.0's own code computed for these prompts;
the decisions must name exactly those ids.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from devtools.vllm_engine import TAGGED, EnginePublisher
from executor.decision import Decision
from executor.kvhints import SCHEMA_PATH, decisions_from_record, make_ack
from serving.bridge import Bridge
from serving.kafka_io import KafkaDecisionSink, KafkaEventProducer, ensure_topics, read_topic
from serving.serve_cli import Service
from serving.settings import load_settings
from serving.zmq_source import ZmqSubscriber, parse_zmq_url

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

VECTORS = json.loads(
    (Path(__file__).parents[1] / "data" / "vllm_block_hashes" / "vectors.json").read_text()
)
SCHEMA = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text()))


def vllm_case(name: str) -> dict[str, Any]:
    return next(
        c
        for c in VECTORS["cases"]
        if c["name"] == name and c["hash_algo"] == "sha256" and c["pythonhashseed"] is None
    )


def wait_for(
    done: Callable[[], bool],
    timeout_s: float = 120.0,
    step: Callable[[], Any] = lambda: None,
    state: Callable[[], Any] = lambda: None,
) -> None:
    """A bound, not a speed target: a consumer group joining on a loaded 2-core machine
    has taken over 60 s once (CI simulation with a replay running beside it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        step()
        if done():
            return
        time.sleep(0.05)
    raise TimeoutError(f"condition not met in {timeout_s} s; state: {state()}")


def test_vllm_events_and_request_events_through_kafka_give_engine_hashed_hints(
    kafka_bootstrap: str, unique_topic: Callable[[str], str]
) -> None:
    events, decisions, acks = unique_topic("events"), unique_topic("hints"), unique_topic("acks")
    # One partition: the engine's residency must be read before the requests that
    # find those blocks in CPU (across partitions the consumer may read either first).
    ensure_topics(kafka_bootstrap, {events: 1, decisions: 1, acks: 1})
    offloaded, other = vllm_case("plain-16"), vllm_case("lora")
    with EnginePublisher() as publisher:
        subscriber = ZmqSubscriber(parse_zmq_url(publisher.url("vllm-0")))
        producer = KafkaEventProducer(kafka_bootstrap, events, client_id="test-bridge")
        bridge = Bridge(subscriber, producer, topic=events, num_partitions=1)
        try:
            publisher.heartbeat_until(
                lambda: bridge.step(timeout_ms=20) >= 0 and bool(bridge.delivered_seq)
            )
            # The engine offloaded the first prompt's two blocks to CPU.
            stored = TAGGED.BlockStored(  # type: ignore[call-arg]
                block_hashes=offloaded["event_ids"], parent_block_hash=None,
                token_ids=offloaded["tokens"][:32], block_size=16, lora_id=None,
                medium="CPU", lora_name=None,
            )  # fmt: skip
            publisher.publish(
                TAGGED.KVEventBatch(ts=time.time(), events=[stored], data_parallel_rank=0)
            )
            seq = publisher.next_seq - 1
            wait_for(
                lambda: bridge.delivered_seq.get("vllm-0") == seq,
                step=lambda: bridge.step(timeout_ms=20),
            )
        finally:
            bridge.flush()
            subscriber.close()
        # The router publishes request events (token ids) to the same topic, after.
        now_ms = int(time.time() * 1000)
        for i, case in enumerate((offloaded, other)):
            body = {
                "request_id": f"r{i}",
                "ts_ms": now_ms + i,
                "engine_id": "vllm-0",
                "token_ids": case["tokens"],
            }
            if case.get("lora"):
                body["lora_name"], body["lora_path"] = case["lora"]
            producer.send_raw(json.dumps(body).encode(), key=b"router")
        producer.send_raw(
            json.dumps({"engine_id": "vllm-9", "ts_ms": now_ms, "token_ids": [5] * 32}).encode()
        )
        producer.flush()
        producer.close()

    settings = load_settings(
        None,
        source=f"kafka://{kafka_bootstrap}/{events}",
        kafka_group_id=unique_topic("group"),
        executor="none",
        decisions=(f"kafka://{kafka_bootstrap}/{decisions}",),
        decisions_format="kvhints",
        decisions_ack_topic=acks,
        engine_id="vllm-0",
        http_port=0,
        model_poll_interval_s=0,
        prefetch=False,
        poll_timeout_ms=50,
    )
    service = Service(settings).start()
    runner = threading.Thread(target=service.run, daemon=True)
    runner.start()
    try:
        wait_for(
            lambda: (
                service.sidecar.stats.requests == 2
                and service.source.stats()["events_other_engine"] == 1
            ),
            state=lambda: (service.sidecar.stats, service.source.stats()),
        )
        wait_for(lambda: any(read_topic(kafka_bootstrap, decisions, timeout_s=10)))
        records = read_topic(kafka_bootstrap, decisions, timeout_s=10)
        envelopes = [json.loads(r.value) for r in records]
        for envelope in envelopes:
            SCHEMA.validate(envelope)
        got = [d for r in records for d in decisions_from_record(r.value)]
        promoted = [d for d in got if d.action == "promote"]
        assert {d.block_hash for d in promoted} == set(offloaded["event_ids"])
        assert all((d.from_tier, d.to_tier) == ("dram", "hbm") for d in promoted)
        assert not {d.block_hash for d in got} & set(other["event_ids"])

        # An executor acknowledges every action; the sidecar reads the acks back.
        with KafkaEventProducer(kafka_bootstrap, acks, client_id="test-executor") as executor:
            for envelope in envelopes:
                results = [(a["action_id"], "accepted", "") for a in envelope["actions"]]
                executor.send_raw(json.dumps(make_ack(envelope["message_id"], results)).encode())
            executor.send_raw(b'{"not": "an ack"}')
        # The malformed ack was sent last; wait for it too (the reader counts as it goes).
        # Twice in fresh-clone CI runs no ack was read at all: kafka-python left the ack
        # reader's group join unfinished (serving.kafka_io.heal_stalled_join; reproduced
        # here in 3 of 7 runs beside two busy processes, 0 of 12 with the heal).
        wait_for(
            lambda: (
                service.acks().get("accepted", 0) == len(got)
                and service.acks().get("malformed") == 1
            ),
            state=lambda: (dict(service.acks()), len(got)),
        )
        assert service.http is not None
        with urllib.request.urlopen(service.http.url + "/metrics", timeout=10) as reply:
            metrics = reply.read().decode()
        assert f'kvwarm_hint_acks_total{{status="accepted"}} {float(len(got))}' in metrics
    finally:
        service.stop()
        runner.join(timeout=20)
        service.close()


def test_kafka_sink_round_trips_both_formats(
    kafka_bootstrap: str, unique_topic: Callable[[str], str]
) -> None:
    batch = [
        Decision("a", 1, 2**64 - 1, "promote", "nvme", "hbm", 0.5, "lru", "1", 9),
        Decision("b", 2, 7, "demote", "hbm", "dram", None, "lru", "1", None),
        Decision("c", 3, 8, "evict", "nvme", None, -1.0, "lgbm", "", 12),
        Decision("d", 4, 9, "pin", None, None, None, "lru", "", None),
        Decision("e", 5, 9, "unpin", None, None, None, "lru", "", None),
    ]
    for fmt in ("native", "kvhints"):
        topic = unique_topic(fmt)
        ensure_topics(kafka_bootstrap, {topic: 1})
        with KafkaDecisionSink(kafka_bootstrap, topic, decision_format=fmt) as sink:
            sink.emit(batch)
            sink.flush()
        records = read_topic(kafka_bootstrap, topic)
        if fmt == "kvhints":
            assert len(records) == 1
            SCHEMA.validate(json.loads(records[0].value))
        else:
            # One record per emit, keyed by its first decision's block hash.
            assert [r.key for r in records] == [str(batch[0].block_hash).encode()]
        assert [d for r in records for d in decisions_from_record(r.value)] == batch
