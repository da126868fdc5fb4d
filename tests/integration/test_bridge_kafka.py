"""The ZMQ -> Kafka bridge against the real broker: a vLLM-protocol publisher on real
PUB/ROUTER sockets, the bridge with kafka_io's producer, then the topic read back (and
decoded as the Kafka source decodes it)."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from devtools.vllm_engine import POSITIONAL, TAGGED, EnginePublisher, VllmStructs, encode_batch
from features.decoders import decode_kv_event_batch, decode_message
from features.events import AllBlocksCleared
from serving.bridge import (
    HEADER_ENGINE,
    HEADER_EVENT_INDEX,
    HEADER_SEQ,
    Bridge,
    bridge,
)
from serving.kafka_io import (
    HEADER_REASON,
    KafkaEventProducer,
    ensure_topics,
    read_topic,
)
from serving.zmq_source import ZmqSubscriber, parse_zmq_url

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SHA = bytes(range(32))


stored = VllmStructs.stored


def workload() -> list[bytes]:
    """Chains in both encodings, int and bytes hashes, offload location updates in
    several medium spellings, removals, one clear, and two malformed payloads."""
    payloads: list[bytes] = []
    for i in range(40):
        s = TAGGED if i % 2 else POSITIONAL
        root = 10_000 * (i % 5 + 1)  # five prefix trees, extended turn after turn
        depth = i // 5
        hashes = [root + 10 * depth + j for j in range(4)]
        parent = None if depth == 0 else root + 10 * (depth - 1) + 3
        events = [stored(s, hashes, parent=parent)]
        if i % 3 == 0:
            events.append(
                stored(
                    s, hashes[:2], medium=["cpu", "CPU_PINNED", "Disk"][i % 9 // 3], tokens=False
                )
            )
        if i % 7 == 6:
            events.append(s.BlockRemoved(block_hashes=hashes[2:], medium="GPU"))
        if i == 11:
            events.append(stored(s, [SHA], parent=hashes[-1]))
        if i == 25:
            events.append(s.AllBlocksCleared())
        payloads.append(
            encode_batch(
                s.KVEventBatch(ts=1_700_000_000.0 + i, events=events, data_parallel_rank=0)
            )
        )
    payloads.insert(13, b"\xc1 not msgpack")
    payloads.insert(29, msgspec.msgpack.encode([1.0, [["BlockRemoved", ["x"], "GPU"]]]))
    return payloads


def test_every_event_arrives_once_with_headers_and_bad_payloads_in_the_dlq(
    kafka_bootstrap: str, unique_topic: Callable[[str], str]
) -> None:
    topic = unique_topic("kv")
    dlq = topic + ".dlq"
    ensure_topics(kafka_bootstrap, {topic: 3, dlq: 1})
    payloads = workload()
    dropped = {5, 6, 30}  # lost on the wire; the bridge fills them from replay
    with EnginePublisher() as publisher:
        subscriber = ZmqSubscriber(parse_zmq_url(publisher.url("rank0")))
        producer = KafkaEventProducer(kafka_bootstrap, topic, client_id="test-bridge")
        runner = Bridge(subscriber, producer, topic=topic, num_partitions=3, dead_letter_topic=dlq)
        try:

            def seen() -> bool:
                runner.step(timeout_ms=20)
                return subscriber.streams["rank0"].last_seq is not None

            publisher.heartbeat_until(seen, timeout_s=10)
            seqs = [publisher.publish_payload(p, drop=i in dropped) for i, p in enumerate(payloads)]
            deadline = time.monotonic() + 30
            while subscriber.streams["rank0"].last_seq != seqs[-1]:
                assert time.monotonic() < deadline, runner.stats()
                runner.step(timeout_ms=50)
        finally:
            subscriber.close()
            producer.close()

    records = read_topic(kafka_bootstrap, topic)
    dead = read_topic(kafka_bootstrap, dlq)

    # Expected: one record per event of every decodable batch; clears once per partition.
    expected: dict[tuple[bytes, bytes], object] = {}
    bad: dict[bytes, bytes] = {}
    for seq, payload in zip(seqs, payloads, strict=True):
        try:
            events = decode_kv_event_batch(payload)
        except Exception:
            bad[str(seq).encode()] = payload
            continue
        for index, event in enumerate(events):
            expected[(str(seq).encode(), str(index).encode())] = event
    got: dict[tuple[bytes, bytes], list] = defaultdict(list)
    for r in records:
        assert r.headers[HEADER_ENGINE] == b"rank0"
        got[(r.headers[HEADER_SEQ], r.headers[HEADER_EVENT_INDEX])].append(r)
    assert set(got) == set(expected)
    for key, event in expected.items():
        copies = got[key]
        if isinstance(event, AllBlocksCleared):
            assert sorted(r.partition for r in copies) == [0, 1, 2]
        else:
            assert len(copies) == 1, key  # once: no failure, so no redelivery
        assert decode_message(copies[0].value) == [event]

    # One prefix tree, one key, one partition.
    partitions_by_key: dict[bytes, set[int]] = defaultdict(set)
    for r in records:
        partitions_by_key[r.key].add(r.partition)
    assert all(len(p) == 1 for k, p in partitions_by_key.items() if k != b"rank0")
    tree_keys = {r.key for r in records if r.key != b"rank0"}
    assert tree_keys == {str(10_000 * (t + 1)).encode() for t in range(5)}

    assert {(r.headers[HEADER_SEQ], r.headers[HEADER_REASON], r.value) for r in dead} == {
        (seq, b"not_msgpack" if p.startswith(b"\xc1") else b"bad_hash", p) for seq, p in bad.items()
    }
    assert runner.stats()["engines"]["rank0"]["replayed"] == len(dropped)

    # Within a key, records are in engine order (one partition keeps order).
    by_key: dict[bytes | None, list[tuple[int, int]]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        by_key[r.key].append((int(r.headers[HEADER_SEQ]), int(r.headers[HEADER_EVENT_INDEX])))
    assert all(order == sorted(order) for order in by_key.values())


def test_bridge_command_resumes_from_its_state_file(
    kafka_bootstrap: str, unique_topic: Callable[[str], str], tmp_path: Path
) -> None:
    topic = unique_topic("kv")
    state = tmp_path / "bridge.json"
    with EnginePublisher() as publisher:
        # Published before any bridge runs: the state file says nothing was delivered
        # yet (-1), so the command fetches them from the replay buffer.
        seqs = [
            publisher.publish(TAGGED.KVEventBatch(ts=1.0, events=[stored(TAGGED, [i + 1])]))
            for i in range(20)
        ]
        state.write_text(json.dumps({"delivered_seq": {"e0": -1}}))
        result: dict = {}

        def run() -> None:
            result["r"] = CliRunner().invoke(
                bridge,
                [
                    "--from", publisher.url("e0"),
                    "--to", f"kafka://{kafka_bootstrap}/{topic}",
                    "--partitions", "2",
                    "--state", str(state),
                    "--max-batches", "21",
                    "--duration-s", "60",
                ],
            )  # fmt: skip

        thread = threading.Thread(target=run)
        thread.start()
        while thread.is_alive():
            publisher.heartbeat()  # the first one the bridge sees reveals the gap
            thread.join(0.05)
    outcome = result["r"]
    assert outcome.exit_code == 0, outcome.output
    stats = json.loads(outcome.stdout[outcome.stdout.index("{") :])
    assert stats["engines"]["e0"]["replayed"] >= 20 and stats["engines"]["e0"]["unfilled"] == 0
    records = read_topic(kafka_bootstrap, topic)
    assert sorted(int(r.headers[HEADER_SEQ]) for r in records) == seqs
    assert sorted(int(r.key) for r in records) == list(range(1, 21))
    assert Bridge.load_state(state)["e0"] >= seqs[-1]
