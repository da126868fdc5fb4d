"""Poison pills through the real broker never stop the stream or crash-loop a consumer.

The issue's pills (a 400-digit timestamp, a timestamp >= 2^63 - 1, a 2 KB line nested
1,000 levels deep) are dead-lettered at decode time; an event that decodes but makes
handling raise is dead-lettered by the loop. Every valid event is handled and the
group's committed offsets end past every pill: a restarted consumer gets nothing again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest

from features.events import BlocksAccessed, Event
from predictor.baselines import LRUPolicy
from serving.kafka_io import (
    HEADER_REASON,
    KafkaEventProducer,
    KafkaEventSource,
    ensure_topics,
    read_topic,
)
from serving.loop import Sidecar
from serving.placement import Placement
from serving.planner import Planner

pytestmark = [
    pytest.mark.integration,
    pytest.mark.chaos,
]

NUM_VALID = 300
POISON_REQUEST = "poison-handler"

PILLS: list[tuple[bytes, str]] = [
    (
        b'{"ts_ms": ' + b"9" * 400 + b', "request_id": "p1", "block_hashes": [1], '
        b'"block_size_tokens": 16}',
        "ts_out_of_range",
    ),  # fmt: skip
    (
        json.dumps(
            {"ts_ms": 2**63 - 1, "request_id": "p2", "block_hashes": [1], "block_size_tokens": 16}
        ).encode(),
        "ts_out_of_range",
    ),  # fmt: skip
    (b"[" * 1000 + b"]" * 1000, "too_deep"),
]


class _RaisesOnOneRequest(LRUPolicy):
    def observe(self, event: Event) -> None:
        if isinstance(event, BlocksAccessed) and event.request_id == POISON_REQUEST:
            raise OverflowError("int too large to convert to float")
        super().observe(event)


def test_poison_pills_are_dead_lettered_and_the_offset_moves_past_them(
    kafka_bootstrap: str, unique_topic: Callable[[str], str]
) -> None:
    topic, group = unique_topic("events"), unique_topic("group")
    ensure_topics(kafka_bootstrap, {topic: 1, topic + ".dlq": 1})
    with KafkaEventProducer(kafka_bootstrap, topic) as producer:
        for i in range(NUM_VALID):
            rid = POISON_REQUEST if i == 150 else f"ok-{i}"
            producer.send_event(
                BlocksAccessed(
                    ts_ms=i, request_id=rid, block_hashes=(i, i + 1), block_size_tokens=16
                )
            )
            if i % 100 == 50:
                for payload, _ in PILLS:
                    producer.send_raw(payload, key=b"pill")
        producer.flush()
    num_pills = 3 * len(PILLS)

    sidecar = Sidecar(_RaisesOnOneRequest(), Planner(), Placement(["hbm", "dram"], [64, 256]))
    with KafkaEventSource(kafka_bootstrap, topic, group_id=group) as source:
        deadline = time.monotonic() + 60
        while source.stats()["messages"] < NUM_VALID + num_pills and time.monotonic() < deadline:
            # One non-empty batch per call: run() returns once it has handled
            # max_events, and on a drained topic it polls until then. With 64 the last
            # call (fewer events left) never returned: that was the "hang" this test
            # was skipped for, not the consumer.
            sidecar.run(source, batch_size=64, poll_timeout_ms=200, max_events=1)
        stats = source.stats()
    assert sidecar.stats.requests == NUM_VALID - 1
    assert stats["dead_letters_by_reason"] == {
        "ts_out_of_range": 6,
        "too_deep": 3,
        "handler_error": 1,
    }

    letters = read_topic(kafka_bootstrap, topic + ".dlq")
    reasons = sorted(r.headers[HEADER_REASON].decode() for r in letters)
    assert reasons == sorted(["ts_out_of_range"] * 6 + ["too_deep"] * 3 + ["handler_error"])
    handler_letter = next(r for r in letters if r.headers[HEADER_REASON] == b"handler_error")
    assert json.loads(handler_letter.value)["request_id"] == POISON_REQUEST

    # A restart of the group gets nothing: the committed offsets are past every pill.
    with KafkaEventSource(kafka_bootstrap, topic, group_id=group) as again:
        got: list[Event] = []
        for _ in range(15):
            got += again.poll(100, timeout_ms=200)
    print(f"kafka poison pills: {num_pills} pills + 1 handler poison dead-lettered, "
          f"{sidecar.stats.requests} valid handled, {len(got)} redelivered after restart")  # fmt: skip
    assert got == []
