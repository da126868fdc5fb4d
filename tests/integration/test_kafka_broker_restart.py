"""The broker process stops and starts again (same data dir, same ports) while a
producer and a consumer are mid-stream: both recover on their own and no event is lost.

This test runs its own broker: restarting the shared one would disturb other tests,
and an external ``KVWARM_KAFKA_BOOTSTRAP`` broker cannot be restarted from here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from devtools.kafka_broker import KafkaBroker
from features.events import BlocksAccessed
from serving.kafka_io import (
    KafkaDecisionSink,
    KafkaDeliveryError,
    KafkaEventProducer,
    KafkaEventSource,
    ensure_topics,
)

pytestmark = pytest.mark.integration

NUM_EVENTS = 3_000
RATE_PER_S = 600  # about 5 s of producing, the restart falls in the middle
RESTART_AFTER = 800  # consumed events before the broker is stopped


def test_producer_and_consumer_survive_a_broker_restart(
    own_kafka_broker: KafkaBroker, unique_topic: Callable[[str], str]
) -> None:
    broker = own_kafka_broker
    bootstrap = broker.bootstrap
    topic = unique_topic("events")
    ensure_topics(bootstrap, {topic: 2})
    events = [
        BlocksAccessed(
            ts_ms=i, request_id=f"r{i}", block_hashes=(i % 11, 500 + i), block_size_tokens=16
        )
        for i in range(NUM_EVENTS)
    ]
    producer_errors: list[BaseException] = []

    def produce() -> None:
        try:
            with KafkaEventProducer(bootstrap, topic) as producer:
                started = time.monotonic()
                for i, event in enumerate(events):
                    delay_s = i / RATE_PER_S - (time.monotonic() - started)
                    if delay_s > 0:
                        time.sleep(delay_s)
                    producer.send_event(event)
                producer.flush(timeout_s=90)
        except BaseException as exc:  # reported by the main thread
            producer_errors.append(exc)

    thread = threading.Thread(target=produce, name="producer", daemon=True)
    seen: list[str] = []
    restarted_at: int | None = None
    with KafkaEventSource(bootstrap, topic, group_id=unique_topic("group")) as source:
        thread.start()
        deadline = time.monotonic() + 120
        while len(set(seen)) < NUM_EVENTS and time.monotonic() < deadline:
            seen.extend(e.request_id for e in source.poll(200, timeout_ms=200))
            source.commit()
            if restarted_at is None and len(seen) >= RESTART_AFTER:
                restarted_at = len(seen)
                assert broker.stop(grace_s=30)
                assert not broker.status().running
                time.sleep(1.0)  # clients see the broker gone, not just a blip
                broker.start(timeout_s=90)
        stats = source.stats()
    thread.join(timeout=60)

    assert restarted_at is not None and restarted_at < NUM_EVENTS
    assert not thread.is_alive()
    assert producer_errors == []  # every send acknowledged, with no manual action
    assert set(seen) == {e.request_id for e in events}  # nothing lost
    assert stats["dead_letters"] == 0


def test_a_source_whose_broker_is_gone_commits_and_closes_without_waiting(
    own_kafka_broker: KafkaBroker, unique_topic: Callable[[str], str]
) -> None:
    """With the broker stopped, ``commit()`` (offsets to send) returns at once and
    ``close()`` within a few seconds (the source's, and a decision sink's holding
    decisions the broker never took), where librdkafka's synchronous commit and its
    close each wait up to a session timeout for a coordinator (46 s measured with its
    default of 45 s). Nothing is lost: once the broker is back, the group's next
    consumer gets what came after, and of what came before at most what was handled
    (at least once: the commit in flight may or may not have reached the broker)."""
    broker = own_kafka_broker
    bootstrap = broker.bootstrap
    topic, group = unique_topic("events"), unique_topic("group")
    ensure_topics(bootstrap, {topic: 1})

    def send(ids: list[int]) -> None:
        with KafkaEventProducer(bootstrap, topic) as producer:
            for i in ids:
                producer.send_event(
                    BlocksAccessed(
                        ts_ms=i, request_id=f"r{i}", block_hashes=(i,), block_size_tokens=16
                    )
                )

    def read(source: KafkaEventSource, want: str) -> list[str]:
        got: list[str] = []
        deadline = time.monotonic() + 90
        while want not in got:
            assert time.monotonic() < deadline, f"read {got}, waiting for {want}"
            got.extend(e.request_id for e in source.poll(100, timeout_ms=200))
        return got

    send(list(range(10)))
    source = KafkaEventSource(bootstrap, topic, group_id=group)
    sink = KafkaDecisionSink(bootstrap, unique_topic("decisions"))
    try:
        seen = read(source, "r9")
        assert broker.stop(grace_s=30)
        started = time.monotonic()
        source.commit()
        assert time.monotonic() - started < 5.0
        source.poll(10, timeout_ms=500)
        started = time.monotonic()
        source.close()
        assert time.monotonic() - started < 5.0
        # Decisions the broker never took: close says so, within seconds (librdkafka
        # would wait their 120 s delivery timeout), and their events were not committed.
        sink.emit([{"block_hash": 1, "action": "promote"}])
        started = time.monotonic()
        with pytest.raises(KafkaDeliveryError, match="1 records"):
            sink.close()
        assert time.monotonic() - started < 5.0
    finally:
        source.close()
        broker.start(timeout_s=90)
    send([10])
    with KafkaEventSource(bootstrap, topic, group_id=group) as again:
        after = read(again, "r10")
    assert set(after) - {"r10"} <= set(seen)
