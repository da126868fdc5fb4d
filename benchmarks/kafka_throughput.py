"""``kvwarm bench kafka``: block accesses per second through a real broker (produce, and
consume+decode through ``KafkaEventSource``) on one partition and on four, and
produce->consume latency, as ratios against decoding the same payloads from memory in
this process.

The broker is ``--bootstrap`` / ``$KVWARM_KAFKA_BOOTSTRAP`` when given, else one started
for the run (``devtools.kafka_broker``) and removed afterwards.
"""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import click
import msgspec
import numpy as np

from devtools.kafka_broker import KafkaBroker
from features.decoders import decode_message, decode_mooncake
from features.events import AllBlocksCleared, BlocksAccessed, Event
from features.generator import generate, params_for


@dataclass(frozen=True)
class Rate:
    label: str
    num_events: int
    num_blocks: int
    elapsed_s: float

    @property
    def blocks_per_s(self) -> float:
        return self.num_blocks / self.elapsed_s

    @property
    def events_per_s(self) -> float:
        return self.num_events / self.elapsed_s

    def line(self, baseline: Rate | None) -> str:
        ratio = (
            "baseline" if baseline is None else f"{self.blocks_per_s / baseline.blocks_per_s:.3f}x"
        )
        return (
            f"{self.label:<40} {self.blocks_per_s:>12,.0f} block accesses/s "
            f"{self.events_per_s:>9,.0f} events/s  {ratio}"
        )


def bench_events(num_requests: int, seed: int = 0) -> list[BlocksAccessed]:
    rows = generate(params_for("mixed", num_requests=num_requests, seed=seed))
    return [decode_mooncake(row, f"bench-{i}") for i, row in enumerate(rows)]


def decode_from_memory(events: list[BlocksAccessed]) -> Rate:
    """The baseline: the same canonical JSON payloads decoded without Kafka."""
    payloads = [msgspec.json.encode(e.to_dict()) for e in events]
    start = time.perf_counter()
    num_blocks = 0
    for i, payload in enumerate(payloads):
        for event in decode_message(payload, request_id=str(i)):
            num_blocks += len(event.block_hashes)
    return Rate("decode only, from memory", len(events), num_blocks, time.perf_counter() - start)


def _num_blocks(events: list[Event]) -> int:
    return sum(len(e.block_hashes) for e in events if not isinstance(e, AllBlocksCleared))


def produce_and_consume(
    bootstrap: str, events: list[BlocksAccessed], partitions: int
) -> tuple[Rate, Rate]:
    from serving.kafka_io import KafkaEventProducer, KafkaEventSource, ensure_topics

    topic = f"kvwarm.bench.kafka.{partitions}p.{uuid.uuid4().hex[:8]}"
    ensure_topics(bootstrap, {topic: partitions})
    num_blocks = sum(len(e.block_hashes) for e in events)
    with KafkaEventProducer(bootstrap, topic, client_id="kvwarm-bench") as producer:
        start = time.perf_counter()
        for event in events:
            producer.send_event(event)
        producer.flush()
        produced = Rate(
            f"produce ({partitions} partition{'s' * (partitions > 1)}, acked)",
            len(events),
            num_blocks,
            time.perf_counter() - start,
        )
    with KafkaEventSource(bootstrap, topic, group_id=topic + ".g") as source:
        got = source.poll(1, timeout_ms=10_000)  # join the group before timing
        start = time.perf_counter()
        blocks = _num_blocks(got)
        count = len(got)
        while count < len(events):
            batch = source.poll(1000, timeout_ms=1000)
            count += len(batch)
            blocks += _num_blocks(batch)
            source.commit()
        elapsed = time.perf_counter() - start
    consumed = Rate(
        f"consume+decode ({partitions} partition{'s' * (partitions > 1)})", count, blocks, elapsed
    )
    return produced, consumed


def latency_ms(bootstrap: str, rate_per_s: float, duration_s: float) -> tuple[np.ndarray, int]:
    """Produce at a steady rate from a thread and consume in this one; returns each
    event's produce-call -> handed-out-by-poll latency. Producer linger 0 (no batching
    delay); the consumer's fetch wait is 100 ms, so an idle stream answers at once."""
    from serving.kafka_io import KafkaEventProducer, KafkaEventSource, ensure_topics

    topic = f"kvwarm.bench.latency.{uuid.uuid4().hex[:8]}"
    ensure_topics(bootstrap, {topic: 1})
    sent_at: dict[str, float] = {}
    latencies: list[float] = []
    num_events = int(rate_per_s * duration_s)
    with (
        KafkaEventProducer(bootstrap, topic, client_id="kvwarm-bench", linger_ms=0) as producer,
        KafkaEventSource(bootstrap, topic, group_id=topic + ".g") as source,
    ):
        warmup = BlocksAccessed(
            ts_ms=0, request_id="warmup", block_hashes=(1,), block_size_tokens=16
        )
        producer.send_event(warmup)
        producer.flush()
        deadline = time.monotonic() + 30
        while not source.poll(10, timeout_ms=200) and time.monotonic() < deadline:
            pass  # the group is joined once the warm-up event arrives
        source.commit()

        def produce() -> None:
            start = time.perf_counter()
            for i in range(num_events):
                delay = i / rate_per_s - (time.perf_counter() - start)
                if delay > 0:
                    time.sleep(delay)
                rid = f"lat-{i}"
                sent_at[rid] = time.perf_counter()
                producer.send_event(
                    BlocksAccessed(
                        ts_ms=i, request_id=rid, block_hashes=(i, i + 1), block_size_tokens=16
                    )
                )
            producer.flush()

        thread = threading.Thread(target=produce, daemon=True)
        thread.start()
        deadline = time.monotonic() + duration_s + 30
        while len(latencies) < num_events and time.monotonic() < deadline:
            for event in source.poll(500, timeout_ms=100):
                now = time.perf_counter()
                assert isinstance(event, BlocksAccessed)
                latencies.append((now - sent_at[event.request_id]) * 1000)
            source.commit()
        thread.join(timeout=30)
    return np.asarray(latencies), num_events


@contextmanager
def _broker(bootstrap: str | None) -> Iterator[str]:
    if bootstrap:
        yield bootstrap
        return
    with tempfile.TemporaryDirectory(prefix="kvwarm-bench-kafka-") as tmp:
        broker = KafkaBroker(tmp, heap_mb=512, fast_start=False, die_with_parent=True)
        start_s = broker.start()
        click.echo(
            f"started a local Kafka {broker.version} broker at {broker.bootstrap} in {start_s:.1f} s"
        )
        try:
            yield broker.bootstrap
        finally:
            broker.stop()


@click.command("kafka")
@click.option(
    "--requests", "num_requests", default=20_000, show_default=True, type=click.IntRange(100)
)
@click.option(
    "--bootstrap",
    default=None,
    envvar="KVWARM_KAFKA_BOOTSTRAP",
    help="HOST:PORT of a broker [default: $KVWARM_KAFKA_BOOTSTRAP, else start one for the run].",
)
@click.option(
    "--latency-rate",
    default=1000.0,
    show_default=True,
    type=click.FloatRange(min=1),
    help="events/s",
)
@click.option("--latency-seconds", default=5.0, show_default=True, type=click.FloatRange(min=0.5))
def bench_kafka(
    num_requests: int, bootstrap: str | None, latency_rate: float, latency_seconds: float
) -> None:
    """Block accesses/s through produce and consume+decode (1 and 4 partitions), and
    p50/p99 produce->consume latency, against decoding from memory."""
    events = bench_events(num_requests)
    num_blocks = sum(len(e.block_hashes) for e in events)
    click.echo(
        f"{len(events):,} access events (mixed workload, seed 0), {num_blocks:,} block accesses"
    )
    baseline = decode_from_memory(events)
    with _broker(bootstrap) as address:
        click.echo(baseline.line(None))
        for partitions in (1, 4):
            produced, consumed = produce_and_consume(address, events, partitions)
            click.echo(produced.line(baseline))
            click.echo(consumed.line(baseline))
        lat, expected = latency_ms(address, latency_rate, latency_seconds)
    if len(lat) < expected:
        click.echo(f"latency: only {len(lat)} of {expected} events arrived in time")
    if len(lat):
        p50, p99 = np.percentile(lat, [50, 99])
        click.echo(
            f"produce->consume latency at {latency_rate:,.0f} events/s, 1 partition, "
            f"{len(lat):,} events: p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {lat.max():.1f} ms"
        )
