"""Bad input on a live ZMQ stream is counted by reason and never stops the stream."""

from __future__ import annotations

import contextlib
import math
import time

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools.vllm_engine import TAGGED, EnginePublisher, encode_batch
from features.decoders import decode_kv_event_batch
from features.events import EventValidationError, Tier
from serving.zmq_source import ZmqEventSource

pytestmark = pytest.mark.timeout(60)

enc = msgspec.msgpack.encode
TS = 1_700_000_000.0

BAD_PAYLOADS = [
    (b"\xc1\xc1 not msgpack at all", "not_msgpack"),
    (b"", "not_msgpack"),
    (enc([TS, [{"type": "BlockExploded", "block_hashes": [1]}]]), "unknown_tag"),
    (enc([TS, [["TierBlocksCleared", "CPU"]]]), "unknown_tag"),
    (enc([TS, [{"type": "BlockStored", "block_hashes": "abc", "medium": "GPU"}]]), "bad_type"),
    (enc([TS, [["BlockStored", [1], None, [1, 2], "16", None, "GPU"]]]), "bad_type"),
    (enc([TS, [["BlockStored", [1], None, 5, 16, None, "GPU"]]]), "bad_type"),
    (enc(["soon", []]), "bad_type"),
    (enc([math.nan, []]), "bad_type"),
    (enc([math.inf, []]), "bad_type"),
    (enc([TS, [["BlockRemoved", [1.5], "GPU"]]]), "bad_hash"),
    (enc([TS, [["BlockRemoved", ["x"], "GPU"]]]), "bad_hash"),
    (enc([TS, [["BlockRemoved", [True], "GPU"]]]), "bad_hash"),
    (enc([TS, [["BlockRemoved", [{"h": 1}], "GPU"]]]), "bad_hash"),
    (enc([TS, [["BlockStored", [1], 2.5, [], 16, None, "GPU"]]]), "bad_hash"),
    (enc([TS, [["BlockRemoved", [1], "TAPE"]]]), "unknown_tier"),
    (enc([TS, [["BlockRemoved", [1], 3]]]), "bad_type"),
    (enc(7), "bad_shape"),
    (enc([TS, [["BlockRemoved", [1], "GPU", 0, "extra", "fields"]]]), "bad_shape"),
    (b"\x91" * 1000 + b"\x90", "too_deep"),  # 1,000 levels: a RecursionError before
]


def test_bad_payloads_and_frames_are_counted_by_reason_and_the_stream_goes_on():
    with EnginePublisher() as publisher:
        source = ZmqEventSource(publisher.url("e0"))
        try:

            def seen() -> bool:
                source.poll(100, timeout_ms=20)
                return source.stats()["engines"]["e0"]["last_seq"] is not None

            publisher.heartbeat_until(seen)
            good = TAGGED.KVEventBatch(
                ts=TS,
                events=[
                    TAGGED.BlockStored(
                        block_hashes=[42],
                        parent_block_hash=None,
                        token_ids=list(range(16)),
                        block_size=16,
                        lora_id=None,
                        medium="GPU",
                        lora_name=None,
                    )
                ],
            )
            for payload, _ in BAD_PAYLOADS:
                publisher.publish_payload(payload)
            publisher.send_frames([b"", (5).to_bytes(8, "big")])  # two frames
            publisher.send_frames([b"", b"\x00\x01\x02", encode_batch(good)])  # 3-byte seq
            publisher.send_frames([b"", (-3).to_bytes(8, "big", signed=True), b"x"])
            publisher.publish(good)
            events: list = []
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and not events:
                events += source.poll(100, timeout_ms=50)
            stats = source.stats()
        finally:
            source.close()

    assert len(events) == 1 and events[0].block_hashes == (42,)
    assert source.residency("e0").tiers(42) == {Tier.HBM}
    expected: dict[str, int] = {}
    for _, reason in BAD_PAYLOADS:
        expected[reason] = expected.get(reason, 0) + 1
    assert stats["rejects_by_reason"] == expected
    assert stats["bad_frames"] == {"bad_frame_count": 1, "bad_seq_frame": 1, "negative_seq": 1}
    # Bad payloads still count as sequence numbers seen: no gap, nothing to replay.
    assert stats["engines"]["e0"]["gaps"] == 0


def test_rejects_file_records_each_bad_batch(tmp_path):
    with EnginePublisher() as publisher:
        rejects = tmp_path / "zmq-rejects.jsonl"
        source = ZmqEventSource(publisher.url("e0"), rejects_path=rejects)
        try:

            def seen() -> bool:
                source.poll(100, timeout_ms=20)
                return source.stats()["engines"]["e0"]["last_seq"] is not None

            publisher.heartbeat_until(seen)
            seq = publisher.publish_payload(b"\xc1 junk")
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and source.rejects.total == 0:
                source.poll(100, timeout_ms=50)
        finally:
            source.close()
    lines = rejects.read_text().splitlines()
    assert len(lines) == 1
    record = msgspec.json.decode(lines[0])
    assert record["reason"] == "not_msgpack" and record["where"] == f"e0#{seq}"
    assert bytes.fromhex(record["raw"]) == b"\xc1 junk"


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "cpu"]),
    lambda children: (
        st.lists(children, max_size=6)
        | st.dictionaries(
            st.sampled_from(["type", "ts", "events", "block_hashes", "medium", "token_ids"]),
            children,
            max_size=5,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ts=st.one_of(st.floats(), st.integers(-(1 << 63), (1 << 64) - 1), st.text(max_size=3)),
    events=st.lists(
        st.one_of(
            st.tuples(
                st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"]),
                msgpack_values,
                msgpack_values,
                msgpack_values,
            ).map(list),
            msgpack_values,
        ),
        max_size=4,
    ),
    noise=st.binary(max_size=4),
)
def test_decoder_raises_only_validation_errors(ts, events, noise):
    payload = enc([ts, events])
    for candidate in (payload, payload[: len(payload) // 2], noise + payload):
        with contextlib.suppress(EventValidationError):  # anything else fails the test
            decode_kv_event_batch(candidate)


def _frames(seq: int, payload: bytes = b"p") -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


def test_one_absurd_sequence_number_is_dropped_and_does_not_reset_residency():
    """A corrupt frame numbered 2**62 used to make every later batch look like an engine
    restart (residency wiped); now it is held, dropped when the next batch does not
    follow on from it, and counted."""
    from serving.zmq_source import EngineEndpoint, ZmqSubscriber

    engine = EngineEndpoint("e0", "tcp://127.0.0.1:1")  # never connected: frames fed directly
    sub = ZmqSubscriber([engine])
    try:
        got = []
        for seq in (1, 2, 3, 1 << 62, 4, 5):
            got += sub._accept(engine, _frames(seq))
        stream = sub.streams["e0"]
        assert [b.seq for b in got] == [1, 2, 3, 4, 5]
        assert not any(b.restart for b in got) and stream.num_restarts == 0
        assert sub.bad_frames["seq_jump"] == 1
    finally:
        sub.close()


def test_a_real_long_jump_is_accepted_once_the_next_batch_follows_on():
    from serving.zmq_source import MAX_SEQ_JUMP, EngineEndpoint, ZmqSubscriber

    engine = EngineEndpoint("e0", "tcp://127.0.0.1:1")
    sub = ZmqSubscriber([engine])
    far = 3 + 5 * MAX_SEQ_JUMP
    try:
        got = []
        for seq in (1, 2, 3, far, far + 1, far + 2):
            got += sub._accept(engine, _frames(seq, str(seq).encode()))
        stream = sub.streams["e0"]
        assert [b.seq for b in got] == [1, 2, 3, far, far + 1, far + 2]
        assert [b.payload for b in got][3] == str(far).encode()  # the held batch is kept
        assert stream.num_restarts == 0 and sub.bad_frames["seq_jump"] == 0
        assert stream.num_unfilled == far - 4 and stream.num_batches == 6
    finally:
        sub.close()
