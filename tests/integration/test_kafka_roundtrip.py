"""Round trips through the real broker: trace -> produce -> consume+decode, and
decisions -> sink -> topic."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from devtools.kafka_broker import free_port
from executor.kvhints import make_ack
from features.decoders import read_trace
from features.events import BlocksAccessed
from serving.kafka_io import (
    ConnectOptions,
    KafkaDecisionSink,
    KafkaEventProducer,
    KafkaEventSource,
    KafkaUnavailableError,
    decode_decision_record,
    ensure_topics,
    heal_stalled_join,
    produce_trace,
    read_topic,
    topic_partitions,
)
from serving.sources import EventSource

pytestmark = pytest.mark.integration


def consume(source: KafkaEventSource, num_events: int, timeout_s: float = 60) -> list:
    out: list = []
    deadline = time.monotonic() + timeout_s
    while len(out) < num_events and time.monotonic() < deadline:
        out.extend(source.poll(500, timeout_ms=200))
        source.commit()
    return out


def test_trace_round_trip_every_event_once_in_order_per_prefix_root(
    kafka_bootstrap: str, unique_topic: Callable[[str], str], small_trace: Path
) -> None:
    topic = unique_topic("events")
    assert ensure_topics(kafka_bootstrap, {topic: 3}) == [topic]
    assert ensure_topics(kafka_bootstrap, {topic: 3}) == []  # idempotent
    assert topic_partitions(kafka_bootstrap, topic) == 3
    expected = list(read_trace(small_trace))
    report = produce_trace(small_trace, kafka_bootstrap, topic, progress=False)
    assert report.num_events == len(expected) == 3000
    assert report.num_block_accesses == sum(len(e.block_hashes) for e in expected)

    with KafkaEventSource(kafka_bootstrap, topic, group_id=unique_topic("group")) as source:
        assert isinstance(source, EventSource)
        got = consume(source, len(expected))
        extra = source.poll(500, timeout_ms=500)  # nothing beyond what was produced
        stats = source.stats()

    assert extra == []
    assert len(got) == len(expected)
    assert stats["messages"] == stats["events"] == len(expected)
    assert stats["dead_letters"] == 0
    # Decoded exactly once each, field for field.
    assert sorted(got, key=lambda e: int(e.request_id)) == expected

    # A partition keeps order and the key is the prefix root, so each root's requests
    # arrive in trace order.
    def by_root(events: list[BlocksAccessed]) -> dict[int, list[str]]:
        groups: dict[int, list[str]] = defaultdict(list)
        for e in events:
            groups[e.block_hashes[0] if e.block_hashes else -1].append(e.request_id)
        return groups

    assert by_root(got) == by_root(expected)
    assert len(by_root(expected)) > 3  # several keys, so several partitions are used


def test_consumer_resumes_from_committed_offsets(
    kafka_bootstrap: str, unique_topic: Callable[[str], str], small_trace: Path
) -> None:
    topic, group = unique_topic("events"), unique_topic("group")
    ensure_topics(kafka_bootstrap, {topic: 1})
    produce_trace(small_trace, kafka_bootstrap, topic, limit=400, progress=False)
    with KafkaEventSource(kafka_bootstrap, topic, group_id=group) as first:
        head = consume(first, 150)
        first.commit()
    # Everything handed out was committed, so a new member starts right after it.
    with KafkaEventSource(kafka_bootstrap, topic, group_id=group) as second:
        rest = consume(second, 400 - len(head))
    ids = [e.request_id for e in head + rest]
    assert ids == [str(i) for i in range(400)]


def test_commit_interval_holds_offsets_back_until_it_passes_a_quiet_poll_or_close(
    kafka_bootstrap: str, unique_topic: Callable[[str], str], small_trace: Path
) -> None:
    """With a commit interval, ``commit()`` marks what was handed out as done but sends
    it to the broker at most once per interval; a poll past the interval sends what is
    done (never what that poll hands out), and ``close()`` sends the rest. Commits from
    the loop are asynchronous (the broker has them a round trip later); the one at
    ``close()`` is waited for."""
    from kafka import KafkaConsumer, TopicPartition

    topic, group = unique_topic("events"), unique_topic("group")
    ensure_topics(kafka_bootstrap, {topic: 1})
    produce_trace(small_trace, kafka_bootstrap, topic, limit=300, progress=False)
    tp = TopicPartition(topic, 0)
    watcher = KafkaConsumer(
        bootstrap_servers=kafka_bootstrap, group_id=group, enable_auto_commit=False
    )
    interval_s = 3.0
    try:
        source = KafkaEventSource(
            kafka_bootstrap, topic, group_id=group, commit_interval_ms=int(interval_s * 1000)
        )
        first: list = []
        while len(first) < 100:
            first += source.poll(100 - len(first), timeout_ms=500)
        source.commit()  # the first commit goes at once
        sent_at = time.monotonic()

        def eventually(offset: int) -> None:
            deadline = time.monotonic() + 10
            while watcher.committed(tp) != offset:
                assert time.monotonic() < deadline, f"committed {watcher.committed(tp)}"
                time.sleep(0.02)

        eventually(100)
        second = source.poll(50, timeout_ms=500)
        assert second
        source.commit()  # within the interval: marked done, held back
        if time.monotonic() - sent_at < interval_s:
            assert watcher.committed(tp) == 100
        time.sleep(max(0.0, interval_s - (time.monotonic() - sent_at)) + 0.2)
        third = source.poll(50, timeout_ms=500)  # sends what is done, hands out more
        assert third
        eventually(100 + len(second))
        source.commit()  # held back again: the poll just sent
        source.close()
        assert watcher.committed(tp) == 100 + len(second) + len(third)
        assert source.stats()["commits"] == 3
    finally:
        watcher.close()


def test_a_join_kafka_python_leaves_unfinished_is_healed_and_the_ack_reader_reads(
    kafka_bootstrap: str, unique_topic: Callable[[str], str]
) -> None:
    """kafka-python 3.0 leaves a rejoin unfinished when the poll's timeout passes as it
    ends: a consumer that joins before it knows its topic's partitions, polled every
    5 ms, was never assigned anything in 15 of 15 tries without ``heal_stalled_join``
    (each waited 8 s). With it, every one is assigned. The ack reader (whose 200 ms polls
    hit the same stall under load in CI) reads acks sent before and after it joins."""
    from kafka import KafkaConsumer

    for attempt in range(3):
        topic = unique_topic(f"join{attempt}")
        ensure_topics(kafka_bootstrap, {topic: 1})
        consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=topic)
        try:
            consumer.subscribe([topic])  # before its metadata: the first join assigns nothing
            deadline = time.monotonic() + 60
            while not consumer.assignment():
                assert time.monotonic() < deadline, f"attempt {attempt}: never assigned"
                consumer.poll(timeout_ms=5)
                heal_stalled_join(consumer)
        finally:
            consumer.close()

    acks, decisions = unique_topic("acks"), unique_topic("decisions")
    ensure_topics(kafka_bootstrap, {acks: 1, decisions: 1})
    body = json.dumps(make_ack("m1", [("a1", "accepted", ""), ("a2", "rejected", "full")]))
    with KafkaEventProducer(kafka_bootstrap, acks, client_id="test-executor") as executor:
        executor.send_raw(body.encode())
    sink = KafkaDecisionSink(
        kafka_bootstrap, decisions, decision_format="kvhints", ack_topic=acks,
        ack_group_id=unique_topic("ack-group"),
    )  # fmt: skip
    try:
        with KafkaEventProducer(kafka_bootstrap, acks, client_id="test-executor") as executor:
            executor.send_raw(body.encode())
        deadline = time.monotonic() + 120
        while sink.acks != {"accepted": 2, "rejected": 2}:
            assert time.monotonic() < deadline, f"acks read: {dict(sink.acks)}"
            time.sleep(0.05)
    finally:
        sink.close()


def test_the_source_reads_partitions_added_while_it_runs(
    kafka_bootstrap: str, unique_topic: Callable[[str], str]
) -> None:
    """Partitions added to the events topic while the sidecar consumes it: the group
    leader rejoins for the metadata change and the source reads the new partitions too,
    polled every 5 ms. (Written for kafka-python 3.0, which left that rejoin unfinished
    until ``heal_stalled_join``; the source runs on librdkafka now, and the test stays
    as the contract.)"""
    import msgspec
    from kafka.admin import KafkaAdminClient, NewPartitions

    topic, group = unique_topic("events"), unique_topic("group")
    ensure_topics(kafka_bootstrap, {topic: 1})

    def event(i: int) -> bytes:
        return msgspec.json.encode(
            BlocksAccessed(
                ts_ms=1_000 + i, request_id=f"r{i}", block_hashes=(i,), block_size_tokens=16
            ).to_dict()
        )

    def read(source: KafkaEventSource, want: set[str]) -> None:
        got: set[str] = set()
        deadline = time.monotonic() + 60
        while not want <= got:
            assert time.monotonic() < deadline, f"missing {sorted(want - got)}"
            got |= {e.request_id for e in source.poll(100, timeout_ms=5)}
            source.commit()

    with KafkaEventSource(
        kafka_bootstrap, topic, group_id=group, metadata_max_age_ms=500, commit_interval_ms=0
    ) as source:
        with KafkaEventProducer(kafka_bootstrap, topic) as producer:
            for i in range(5):
                producer.send_record(event(i), partition=0)
        read(source, {f"r{i}" for i in range(5)})
        admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        try:
            admin.create_partitions({topic: NewPartitions(total_count=3)})
        finally:
            admin.close()
        assert topic_partitions(kafka_bootstrap, topic) == 3
        with KafkaEventProducer(kafka_bootstrap, topic) as producer:
            for i in range(5, 11):
                producer.send_record(event(i), partition=i % 3)
        read(source, {f"r{i}" for i in range(5, 11)})


def test_decision_sink_keys_by_block_hash(
    kafka_bootstrap: str, unique_topic: Callable[[str], str]
) -> None:
    topic = unique_topic("decisions")
    ensure_topics(kafka_bootstrap, {topic: 2})

    class Decision:
        def __init__(self, i: int) -> None:
            self.i = i

        def to_dict(self) -> dict:
            return {"decision_id": f"d{self.i}", "block_hash": 1000 + self.i, "action": "promote"}

    from executor.decision import Decision as TypedDecision

    decisions = [
        {"decision_id": f"m{i}", "block_hash": 2**64 - 1 - i, "action": "demote"} for i in range(50)
    ]
    typed = [TypedDecision(f"t{i}", 5, 77 + i, "evict", "nvme") for i in range(3)]
    with KafkaDecisionSink(kafka_bootstrap, topic) as sink:
        assert sink.emit(decisions) == 50
        sink.flush()
        # Emits between two flushes (the requests of one poll) make one record.
        assert sink.emit(Decision(i) for i in range(50)) == 50
        assert sink.emit(typed) == 3
        sink.flush()
    records = read_topic(kafka_bootstrap, topic)
    # One record per flush, keyed by its first decision's block hash.
    assert len(records) == 2
    by_key = {r.key: decode_decision_record(r.value) for r in records}
    assert by_key[str(2**64 - 1).encode()] == decisions
    assert by_key[b"1000"] == [Decision(i).to_dict() for i in range(50)] + [
        d.to_dict() for d in typed
    ]
    assert (
        json.loads(next(r.value for r in records if r.key == b"1000"))[7] == Decision(7).to_dict()
    )

    chunked = topic + "-chunked"
    ensure_topics(kafka_bootstrap, {chunked: 1})
    with KafkaDecisionSink(kafka_bootstrap, chunked, max_decisions_per_record=20) as sink:
        assert sink.emit(decisions[:15]) == 15
        assert sink.emit(decisions[15:30]) == 15
        assert sink.emit(decisions[30:]) == 20
        sink.flush()
    records = read_topic(kafka_bootstrap, chunked)
    assert [len(decode_decision_record(r.value)) for r in records] == [20, 20, 10]
    assert [d for r in records for d in decode_decision_record(r.value)] == decisions
    assert [r.key for r in records] == [
        str(decisions[i]["block_hash"]).encode() for i in (0, 20, 40)
    ]


def test_unreachable_broker_names_the_address() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(KafkaUnavailableError, match=address) as info:
        KafkaEventSource(address, "t", options=ConnectOptions(probe_s=0.3))
    # The TCP probe answers before any client is built: one line, address and fix.
    assert "\n" not in str(info.value) and "kvwarm kafka up" in str(info.value)
    with pytest.raises(KafkaUnavailableError, match=address) as info:
        KafkaEventSource(
            address,
            "t",
            options=ConnectOptions(attempts=2, attempt_timeout_ms=300, backoff_s=0.05, probe_s=0),
        )
    assert "kvwarm kafka status" in str(info.value) and "after 2 tries" in str(info.value)
