"""Bad input through the real broker: 1,000 malformed messages interleaved with 10,000
valid ones. Every valid one is processed, every malformed one lands unchanged in the
dead-letter topic with its reason and source position, and the counts match."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import msgspec
import pytest

from features.decoders import decode_mooncake
from features.events import BlocksAccessed, BlockStored
from features.generator import generate, params_for
from serving.kafka_io import (
    HEADER_REASON,
    HEADER_SOURCE_OFFSET,
    HEADER_SOURCE_PARTITION,
    HEADER_SOURCE_TOPIC,
    KafkaEventProducer,
    KafkaEventSource,
    ensure_topics,
    read_topic,
)

pytestmark = pytest.mark.integration

NUM_VALID = 10_000
NUM_MALFORMED = 1_000
NUM_KV_BATCHES = 500  # of the valid ones: vLLM KVEventBatch msgpack instead of JSON


def kv_batch(i: int, medium: str) -> bytes:
    stored = {
        "type": "BlockStored",
        "block_hashes": [10_000_000 + i],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": medium,
    }
    return msgspec.msgpack.encode([1_700_000_000.0 + i, [stored], 0])


# (payload for malformed message j, the reason the decoders give it)
MALFORMED: list[tuple[Callable[[int], bytes | None], str]] = [
    (lambda j: b'{"ts_ms": %d, "request_id": "bad-' % j, "bad_json"),
    (lambda j: b'{"ts_ms": %d, "request_id": "bad-%d"}' % (j, j), "missing_field"),
    (
        lambda j: (
            b'{"ts_ms": -%d, "request_id": "b%d", "block_hashes": [1], "block_size_tokens": 16}'
            % (j + 1, j)
        ),
        "negative",
    ),
    (
        lambda j: (
            b'{"ts_ms": 1, "request_id": "b%d", "block_hashes": ["x"], "block_size_tokens": 16}' % j
        ),
        "bad_hash",
    ),
    (lambda j: kv_batch(j, "TAPE"), "unknown_tier"),
    (lambda j: b"\xc1not msgpack %d" % j, "not_msgpack"),
    (lambda j: b"", "not_msgpack"),
    (lambda j: None, "empty"),
]


def test_malformed_messages_go_to_the_dead_letter_topic(
    kafka_bootstrap: str, unique_topic: Callable[[str], str]
) -> None:
    topic = unique_topic("events")
    dlq = topic + ".dlq"
    ensure_topics(kafka_bootstrap, {topic: 2, dlq: 1})
    rows = generate(params_for("mixed", num_requests=NUM_VALID - NUM_KV_BATCHES, seed=11))
    valid = [decode_mooncake(row, f"ok-{i}") for i, row in enumerate(rows)]
    assert len(valid) == NUM_VALID - NUM_KV_BATCHES

    injected: Counter[str] = Counter()
    injected_values: Counter[bytes | None] = Counter()
    every = NUM_VALID // NUM_MALFORMED
    with KafkaEventProducer(kafka_bootstrap, topic) as producer:
        for i in range(NUM_VALID):
            if i < len(valid):
                producer.send_event(valid[i])
            else:
                producer.send_raw(kv_batch(i, "cpu"), key=b"kv")
            if i % every == every - 1:
                j = i // every
                make, reason = MALFORMED[j % len(MALFORMED)]
                payload = make(j)
                producer.send_raw(payload, key=b"bad-%d" % j)
                injected[reason] += 1
                injected_values[payload] += 1
        producer.flush()
    assert sum(injected.values()) == NUM_MALFORMED

    accessed: list[BlocksAccessed] = []
    stored: list[BlockStored] = []
    with KafkaEventSource(kafka_bootstrap, topic, group_id=unique_topic("group")) as source:
        deadline = time.monotonic() + 90
        while (
            source.stats()["messages"] < NUM_VALID + NUM_MALFORMED and time.monotonic() < deadline
        ):
            for event in source.poll(1000, timeout_ms=200):
                (accessed if isinstance(event, BlocksAccessed) else stored).append(event)
            source.commit()
        stats = source.stats()

    assert stats["messages"] == NUM_VALID + NUM_MALFORMED
    assert stats["events"] == NUM_VALID
    assert sorted(e.request_id for e in accessed) == sorted(e.request_id for e in valid)
    assert len(stored) == NUM_KV_BATCHES
    assert stats["dead_letters"] == NUM_MALFORMED
    assert stats["dead_letters_by_reason"] == dict(injected)

    letters = read_topic(kafka_bootstrap, dlq)
    assert len(letters) == NUM_MALFORMED
    assert Counter(r.value for r in letters) == injected_values  # unchanged payloads
    assert Counter(r.headers[HEADER_REASON].decode() for r in letters) == injected
    assert {r.headers[HEADER_SOURCE_TOPIC] for r in letters} == {topic.encode()}
    positions = {
        (int(r.headers[HEADER_SOURCE_PARTITION]), int(r.headers[HEADER_SOURCE_OFFSET]))
        for r in letters
    }
    assert len(positions) == NUM_MALFORMED  # each names a distinct source message
    assert all(r.key is not None and r.key.startswith(b"bad-") for r in letters)
