"""The bridge's records (keys, headers, values, dead letters, clears) and its delivery
rules, from a real ZMQ publisher into an in-memory record list. The same path against
the real broker is tests/integration/test_bridge_kafka.py."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import pytest

from devtools.vllm_engine import POSITIONAL, TAGGED, EnginePublisher, VllmStructs
from features.decoders import decode_message
from features.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from serving.bridge import (
    HEADER_ENGINE,
    HEADER_EVENT_INDEX,
    HEADER_SEQ,
    HEADER_SYNTHETIC,
    Bridge,
    BridgeDeliveryError,
    BridgeUrlError,
    PrefixRoots,
    parse_kafka_url,
)
from serving.kafka_io import HEADER_REASON
from serving.zmq_source import ZmqSubscriber, parse_zmq_url

pytestmark = pytest.mark.timeout(60)


@dataclass
class Sent:
    value: bytes
    key: bytes | None
    headers: dict[str, bytes]
    topic: str | None
    partition: int | None


@dataclass
class ListSink:
    """Keeps what was acknowledged; ``fail_flushes`` flushes fail first (and lose what
    they were flushing, as a broker that never acknowledged it)."""

    fail_flushes: int = 0
    acked: list[Sent] = field(default_factory=list)
    _unacked: list[Sent] = field(default_factory=list)

    def send_record(
        self,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
        topic: str | None = None,
        partition: int | None = None,
    ) -> None:
        self._unacked.append(Sent(value, key, dict(headers), topic, partition))

    def flush(self, timeout_s: float | None = None) -> None:
        pending, self._unacked = self._unacked, []
        if self.fail_flushes > 0:
            self.fail_flushes -= 1
            raise RuntimeError("not acknowledged")
        self.acked.extend(pending)


stored = VllmStructs.stored


def batch(s: VllmStructs, *events):
    return s.KVEventBatch(ts=1_700_000_000.0, events=list(events), data_parallel_rank=0)


def wire(publisher: EnginePublisher, runner: Bridge) -> None:
    before = runner.num_batches

    def seen() -> bool:
        runner.step(timeout_ms=20)
        return runner.num_batches > before

    publisher.heartbeat_until(seen)


def run_until_caught_up(publisher: EnginePublisher, runner: Bridge, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while runner.subscriber.streams["e0"].last_seq != publisher.next_seq - 1:
        assert time.monotonic() < deadline, runner.stats()
        runner.step(timeout_ms=20)


@pytest.fixture
def publisher():
    with EnginePublisher() as pub:
        yield pub


def make_bridge(publisher, sink, **kwargs) -> Bridge:
    sub = ZmqSubscriber(parse_zmq_url(publisher.url("e0")), **kwargs.pop("sub", {}))
    return Bridge(sub, sink, topic="kv", num_partitions=3, **kwargs)


@pytest.mark.parametrize("structs", [TAGGED, POSITIONAL], ids=["tagged", "positional"])
def test_records_keys_headers_and_values(publisher, structs):
    sink = ListSink()
    runner = make_bridge(publisher, sink)
    try:
        wire(publisher, runner)
        seq = publisher.publish(
            batch(
                structs,
                stored(structs, [1, 2]),
                stored(structs, [3], parent=2),
                stored(structs, [9], parent=777),  # parent never seen: keyed by the parent
                stored(structs, [3], medium="CPU", tokens=False),  # location update
                structs.BlockRemoved(block_hashes=[3], medium="GPU"),
                structs.AllBlocksCleared(),
            )
        )
        run_until_caught_up(publisher, runner)
    finally:
        runner.subscriber.close()

    records = [r for r in sink.acked if r.headers[HEADER_SEQ] == str(seq).encode()]
    assert [r.key for r in records[:5]] == [b"1", b"1", b"777", b"1", b"1"]
    assert all(r.topic == "kv" and r.partition is None for r in records[:5])
    clears = records[5:]
    assert sorted(r.partition for r in clears) == [0, 1, 2]  # one per partition
    assert {r.key for r in clears} == {b"e0"}
    assert [r.headers[HEADER_EVENT_INDEX] for r in records] == [b"0", b"1", b"2", b"3", b"4"] + [
        b"5"
    ] * 3
    assert {r.headers[HEADER_ENGINE] for r in records} == {b"e0"}
    decoded = [decode_message(r.value) for r in records]
    assert all(len(d) == 1 for d in decoded)
    first = decoded[0][0]
    assert isinstance(first, BlockStored) and first.block_hashes == (1, 2)
    assert first.ts_ms == 1_700_000_000_000 and first.data_parallel_rank == 0
    assert isinstance(decoded[3][0], BlockStored) and decoded[3][0].tier is Tier.DRAM
    assert isinstance(decoded[4][0], BlockRemoved)
    assert isinstance(decoded[5][0], AllBlocksCleared)
    # The engine's encoding is kept: positional events stay arrays, tagged stay maps.
    raw_event = msgspec.msgpack.decode(records[0].value)[1][0]
    assert isinstance(raw_event, list if structs is POSITIONAL else dict)


def test_undecodable_payloads_go_to_the_dead_letter_topic(publisher):
    sink = ListSink()
    runner = make_bridge(publisher, sink)
    try:
        wire(publisher, runner)
        bad = publisher.publish_payload(b"\xc1 not msgpack")
        unknown = publisher.publish_payload(
            msgspec.msgpack.encode([1.0, [{"type": "BlockExploded"}]])
        )
        publisher.publish(batch(TAGGED, stored(TAGGED, [5])))
        run_until_caught_up(publisher, runner)
    finally:
        runner.subscriber.close()
    dead = [r for r in sink.acked if r.topic == "kv.dlq"]
    assert [(r.headers[HEADER_SEQ], r.headers[HEADER_REASON], r.value) for r in dead] == [
        (str(bad).encode(), b"not_msgpack", b"\xc1 not msgpack"),
        (
            str(unknown).encode(),
            b"unknown_tag",
            msgspec.msgpack.encode([1.0, [{"type": "BlockExploded"}]]),
        ),
    ]
    assert [r.key for r in sink.acked if r.topic == "kv"] == [b"5"]
    assert runner.stats()["dead_letters_by_reason"] == {"not_msgpack": 1, "unknown_tag": 1}


def test_engine_restart_sends_a_synthetic_clear_to_every_partition(publisher):
    sink = ListSink()
    runner = make_bridge(publisher, sink)
    try:
        wire(publisher, runner)
        for i in range(10):
            publisher.publish(batch(TAGGED, stored(TAGGED, [i + 100])))
        run_until_caught_up(publisher, runner)
        publisher.restart()

        def restarted() -> bool:
            runner.step(timeout_ms=20)
            return runner.num_restarts > 0

        publisher.heartbeat_until(restarted)
    finally:
        runner.subscriber.close()
    synthetic = [r for r in sink.acked if HEADER_SYNTHETIC in r.headers]
    assert sorted(r.partition for r in synthetic) == [0, 1, 2]
    assert all(r.headers[HEADER_SYNTHETIC] == b"restart" for r in synthetic)
    assert all(isinstance(decode_message(r.value)[0], AllBlocksCleared) for r in synthetic)


def test_a_failed_flush_resends_the_step(publisher):
    sink = ListSink(fail_flushes=2)
    runner = make_bridge(publisher, sink)
    try:
        wire(publisher, runner)  # the warm-up step absorbs the failures (empty batches)
        sink.fail_flushes = 1
        publisher.publish(batch(TAGGED, stored(TAGGED, [1]), stored(TAGGED, [2])))
        run_until_caught_up(publisher, runner)
    finally:
        runner.subscriber.close()
    assert [r.key for r in sink.acked] == [b"1", b"2"]
    assert runner.num_delivery_retries >= 1


def test_delivery_gives_up_without_advancing_the_saved_sequence(publisher, tmp_path):
    state = tmp_path / "bridge-state.json"
    sink = ListSink()
    runner = make_bridge(publisher, sink, state_path=state, delivery_attempts=2)
    try:
        wire(publisher, runner)
        publisher.publish(batch(TAGGED, stored(TAGGED, [1])))
        run_until_caught_up(publisher, runner)
        saved = Bridge.load_state(state)
        assert saved == {"e0": publisher.next_seq - 1}
        sink.fail_flushes = 10
        publisher.publish(batch(TAGGED, stored(TAGGED, [2])))
        with pytest.raises(BridgeDeliveryError, match="restart the bridge|not acknowledged"):
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                runner.step(timeout_ms=20)
    finally:
        runner.subscriber.close()
    assert Bridge.load_state(state) == saved  # the lost step is not marked delivered


def test_a_restarted_bridge_resumes_from_its_state_through_replay(publisher, tmp_path):
    state = tmp_path / "bridge-state.json"
    first = make_bridge(publisher, ListSink(), state_path=state)
    try:
        wire(publisher, first)
        publisher.publish(batch(TAGGED, stored(TAGGED, [1])))
        run_until_caught_up(publisher, first)
    finally:
        first.subscriber.close()
    # While no bridge runs, the engine goes on.
    missed = [publisher.publish(batch(TAGGED, stored(TAGGED, [10 + i]))) for i in range(5)]
    sink = ListSink()
    second = make_bridge(
        publisher, sink, state_path=state, sub={"resume_after": Bridge.load_state(state)}
    )
    saved = Bridge.load_state(state)
    second.flush()  # nothing new delivered: the saved position stays
    assert Bridge.load_state(state) == saved
    try:
        wire(publisher, second)
        run_until_caught_up(publisher, second)
        second.flush()
    finally:
        second.subscriber.close()
    keys = [r.key for r in sink.acked]
    assert keys[:5] == [str(10 + i).encode() for i in range(5)]
    assert [r.headers[HEADER_SEQ] for r in sink.acked[:5]] == [str(s).encode() for s in missed]
    assert second.subscriber.streams["e0"].num_unfilled == 0


def test_prefix_roots_are_bounded():
    roots = PrefixRoots(max_entries=4)
    for i in range(10):
        roots.key_of(BlockStored(0, (i,), None, 16, Tier.HBM, num_tokens=16))
    assert len(roots) == 4
    assert roots.key_of(BlockRemoved(0, (9,), Tier.HBM)) == 9


def test_kafka_url():
    assert parse_kafka_url("kafka://127.0.0.1:9092/kv-events") == ("127.0.0.1:9092", "kv-events")
    assert parse_kafka_url("kafka://a:1,b:2/t") == ("a:1,b:2", "t")
    for bad in ("kafka://host:1", "zmq://h:1/t", "kafka:///t", "kafka://h:1/a/b"):
        with pytest.raises(BridgeUrlError, match="kafka://HOST:PORT"):
            parse_kafka_url(bad)
