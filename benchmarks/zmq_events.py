"""``kvwarm bench zmq``: events per second decoded from a live ZMQ stream, and through the
bridge into Kafka when a broker is given, against decoding the same payloads from memory
in the same process. The engine is ``devtools.vllm_engine.EnginePublisher``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import click

from devtools.vllm_engine import (
    POSITIONAL,
    TAGGED,
    EnginePublisher,
    VllmStructs,
    encode_batch,
)

BLOCK_SIZE_TOKENS = 16
"""vLLM's default block size."""


def bench_payloads(
    num_batches: int,
    *,
    blocks_per_batch: int = 64,
    structs: VllmStructs = TAGGED,
    bytes_hashes: bool = True,
) -> list[bytes]:
    """Engine steps as vLLM sends them: each stores ``blocks_per_batch`` blocks (with their
    token ids) continuing a chain of 8 steps, and from step 16 on evicts the blocks
    stored 16 steps earlier, so residency stays bounded."""

    def block_hash(i: int) -> int | bytes:
        return i.to_bytes(8, "big") * 4 if bytes_hashes else i  # sha256-sized or builtin int

    payloads = []
    tokens = list(range(blocks_per_batch * BLOCK_SIZE_TOKENS))
    for step in range(num_batches):
        first = step * blocks_per_batch + 1
        hashes = [block_hash(first + j) for j in range(blocks_per_batch)]
        parent = None if step % 8 == 0 else block_hash(first - 1)
        events: list[Any] = [
            structs.BlockStored(  # type: ignore[call-arg]
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=tokens,
                block_size=BLOCK_SIZE_TOKENS,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ]
        if step >= 16:
            old = (step - 16) * blocks_per_batch + 1
            events.append(
                structs.BlockRemoved(  # type: ignore[call-arg]
                    block_hashes=[block_hash(old + j) for j in range(blocks_per_batch)],
                    medium="GPU",
                )
            )
        payloads.append(
            encode_batch(structs.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        )
    return payloads


@dataclass(frozen=True)
class Rate:
    name: str
    num_events: int
    num_blocks: int
    elapsed_s: float

    @property
    def events_per_s(self) -> float:
        return self.num_events / self.elapsed_s if self.elapsed_s > 0 else float("inf")

    def line(self, baseline: Rate | None) -> str:
        ratio = f"{self.events_per_s / baseline.events_per_s:6.2f}x" if baseline else "  base "
        return (
            f"{self.name:<34} {self.events_per_s:>12,.0f} events/s "
            f"{self.num_blocks / self.elapsed_s:>14,.0f} block hashes/s  {ratio}"
        )


def _decode_from_memory(payloads: list[bytes]) -> Rate:
    from features.decoders import decode_kv_event_batch
    from serving.zmq_source import Residency

    view = Residency()
    num_events = num_blocks = 0
    start = time.perf_counter()
    for payload in payloads:
        for event in decode_kv_event_batch(payload, engine_id="e0"):
            view.apply(event)
            num_events += 1
            num_blocks += len(getattr(event, "block_hashes", ()))
    return Rate(
        "decode + residency, from memory", num_events, num_blocks, time.perf_counter() - start
    )


def _publish_in_thread(publisher: EnginePublisher, payloads: list[bytes]) -> threading.Thread:
    # The PUB socket moves to this thread until it is joined (a thread start/join is
    # the full memory barrier ZMQ asks for when a socket changes threads).
    thread = threading.Thread(
        target=lambda: [publisher.publish_payload(p) for p in payloads], name="engine-pub"
    )
    thread.start()
    return thread


def _zmq_source(payloads: list[bytes]) -> tuple[Rate, dict[str, Any]]:
    from serving.zmq_source import ZmqEventSource

    with EnginePublisher() as publisher:
        source = ZmqEventSource(publisher.url("e0"))
        try:
            stream = source.subscriber.streams["e0"]
            publisher.heartbeat_until(
                lambda: bool(source.poll(1, timeout_ms=20)) or stream.last_seq is not None
            )
            source.poll(1_000_000, timeout_ms=0)
            last = publisher.next_seq + len(payloads) - 1
            num_events = num_blocks = 0
            start = time.perf_counter()
            thread = _publish_in_thread(publisher, payloads)
            while stream.last_seq != last or source.num_pending:
                for event in source.poll(4096, timeout_ms=100):
                    num_events += 1
                    num_blocks += len(getattr(event, "block_hashes", ()))
            elapsed = time.perf_counter() - start
            thread.join()
            return Rate(
                "ZMQ -> decode + residency", num_events, num_blocks, elapsed
            ), source.stats()
        finally:
            source.close()


def _zmq_receive_only(payloads: list[bytes]) -> Rate:
    from serving.zmq_source import ZmqSubscriber, parse_zmq_url

    with EnginePublisher() as publisher:
        sub = ZmqSubscriber(parse_zmq_url(publisher.url("e0")))
        try:
            stream = sub.streams["e0"]
            publisher.heartbeat_until(
                lambda: bool(sub.receive(100, 20)) or stream.last_seq is not None
            )
            last = publisher.next_seq + len(payloads) - 1
            start = time.perf_counter()
            thread = _publish_in_thread(publisher, payloads)
            while stream.last_seq != last:
                sub.receive(4096, 100)
            elapsed = time.perf_counter() - start
            thread.join()
        finally:
            sub.close()
    # Events are not decoded here; count what the payloads hold for a comparable rate.
    return Rate("ZMQ receive only (no decode)", _count(payloads)[0], _count(payloads)[1], elapsed)


def _count(payloads: list[bytes]) -> tuple[int, int]:
    from features.decoders import decode_kv_event_batch

    events = [e for p in payloads for e in decode_kv_event_batch(p)]
    return len(events), sum(len(getattr(e, "block_hashes", ())) for e in events)


def _kafka_bootstrap(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    from devtools.kafka_broker import KafkaBroker, default_state_dir

    status = KafkaBroker(default_state_dir()).status()
    return status.bootstrap if status.running and status.accepting else None


def _bridge(payloads: list[bytes], bootstrap: str) -> tuple[Rate, Rate]:
    import uuid

    from serving.bridge import Bridge
    from serving.kafka_io import KafkaEventProducer, ensure_topics
    from serving.zmq_source import EngineBatch, ZmqSubscriber, parse_zmq_url

    topic = f"kvwarm-bench-zmq-{uuid.uuid4().hex[:8]}"
    ensure_topics(bootstrap, {topic: 3, topic + ".dlq": 1})
    num_events, num_blocks = _count(payloads)

    # Baseline: the same records, already split and keyed, produced from memory.
    producer = KafkaEventProducer(bootstrap, topic, client_id="kvwarm-bench", linger_ms=5)
    try:
        with EnginePublisher() as publisher:
            splitter = Bridge(
                ZmqSubscriber(parse_zmq_url(publisher.url("e0"))),
                producer,
                topic=topic,
                num_partitions=3,
            )
            records = [
                r for i, p in enumerate(payloads) for r in splitter.records(EngineBatch("e0", i, p))
            ]
            splitter.subscriber.close()
        start = time.perf_counter()
        splitter.deliver(records)
        produce_only = Rate(
            "Kafka produce only, from memory", num_events, num_blocks, time.perf_counter() - start
        )

        with EnginePublisher() as publisher:
            sub = ZmqSubscriber(parse_zmq_url(publisher.url("e0")))
            runner = Bridge(sub, producer, topic=topic, num_partitions=3)
            try:
                stream = sub.streams["e0"]
                publisher.heartbeat_until(
                    lambda: runner.step(timeout_ms=20) >= 0 and stream.last_seq is not None
                )
                last = publisher.next_seq + len(payloads) - 1
                start = time.perf_counter()
                thread = _publish_in_thread(publisher, payloads)
                while stream.last_seq != last:
                    runner.step(max_batches=512, timeout_ms=100)
                runner.flush()  # acknowledged, not just sent
                elapsed = time.perf_counter() - start
                thread.join()
            finally:
                sub.close()
        bridged = Rate("ZMQ -> bridge -> Kafka (acked)", runner.num_events, num_blocks, elapsed)
    finally:
        producer.close()
    return produce_only, bridged


@click.command("zmq")
@click.option("--batches", "num_batches", default=10_000, show_default=True, type=click.IntRange(1))
@click.option("--blocks-per-batch", default=64, show_default=True, type=click.IntRange(1))
@click.option(
    "--encoding", type=click.Choice(["tagged", "positional"]), default="tagged", show_default=True
)
@click.option("--hashes", type=click.Choice(["bytes", "int"]), default="bytes", show_default=True)
@click.option(
    "--kafka",
    "bootstrap",
    default=None,
    envvar="KVWARM_KAFKA_BOOTSTRAP",
    help="HOST:PORT of a broker for the bridge run (default: the `kvwarm kafka up` broker if running).",
)
@click.option("--no-kafka", is_flag=True, help="Skip the bridge run even if a broker is up.")
def bench_zmq(
    num_batches: int,
    blocks_per_batch: int,
    encoding: str,
    hashes: str,
    bootstrap: str | None,
    no_kafka: bool,
) -> None:
    """Events/s decoded from a live ZMQ stream (and bridged into Kafka), against decoding
    the same payloads from memory in this process."""
    structs = TAGGED if encoding == "tagged" else POSITIONAL
    payloads = bench_payloads(
        num_batches,
        blocks_per_batch=blocks_per_batch,
        structs=structs,
        bytes_hashes=hashes == "bytes",
    )
    size = sum(map(len, payloads))
    click.echo(
        f"{num_batches:,} batches of {blocks_per_batch} stored block hashes (+ evictions), "
        f"{encoding} encoding, {hashes} hashes, {size / num_batches:,.0f} bytes/batch"
    )
    baseline = _decode_from_memory(payloads)
    click.echo(baseline.line(None))
    click.echo(_zmq_receive_only(payloads).line(baseline))
    live, stats = _zmq_source(payloads)
    click.echo(live.line(baseline))
    engine = stats["engines"]["e0"]
    click.echo(
        f"{'':<34} events {live.num_events:,}, gaps {engine['gaps']}, replayed "
        f"{engine['replayed']}, unfilled {engine['unfilled']}, rejects {stats['rejects']}"
    )
    address = None if no_kafka else _kafka_bootstrap(bootstrap)
    if address is None:
        click.echo(
            "bridge -> Kafka: skipped (no broker; start one with `kvwarm kafka up` or pass --kafka)"
        )
        return
    produce_only, bridged = _bridge(payloads, address)
    click.echo(produce_only.line(baseline))
    click.echo(bridged.line(baseline))
    click.echo(
        f"{'':<34} bridge / produce-only: {bridged.events_per_s / produce_only.events_per_s:.2f}x"
    )
