"""``kvwarm bridge --from zmq://... --to kafka://HOST:PORT/TOPIC``: engine KV events into Kafka.

Each engine ``KVEventBatch`` is split into one Kafka record per event. The value is a
``KVEventBatch`` holding that one event, in the engine's own encoding (so any consumer of
vLLM's format, ``features.decoders.decode_message`` included, reads it); the key is the
event's prefix root; headers carry the engine id, the batch sequence number and the
event's index in the batch.

Keys: a ``BlockStored`` continues the chain of its ``parent_block_hash``: its key is the
root of that chain as far as the bridge has seen it (else the parent itself); without a
parent (or tokenless) the key is the known root of its first block, else the first block
hash. ``BlockRemoved`` uses its first block the same way. So every event about one
prefix tree lands in one partition, in order. ``AllBlocksCleared`` has no root: it is
sent to every partition (keyed by engine id), so each partition's consumer resets. When
an engine restarts (sequence goes back), a synthetic ``AllBlocksCleared`` with header
``kvwarm.synthetic: restart`` goes out first, the same way.

Delivery is at-least-once: records are handed to the producer (acks=all, idempotent) as
they are read and flushed when the stream is caught up, or every few thousand records or
200 ms under a backlog; a failed flush re-sends everything since the last good one; only
flushed sequences count as delivered, and with ``state_path`` the last delivered sequence
per engine is saved after each flush, so a restarted bridge asks the engines' replay
buffers for what it had not delivered.
Undecodable payloads go unchanged to the dead-letter topic with the reason headers of
``serving.kafka_io``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import click
import msgspec

from features.decoders import kv_events_from_batch
from features.events import (
    AllBlocksCleared,
    BlockStored,
    EventValidationError,
    ResidencyEvent,
)
from serving.kafka_io import DLQ_SUFFIX, HEADER_ERROR, HEADER_REASON
from serving.settings import DEFAULT_EVENTS_TOPIC
from serving.zmq_source import (
    DEFAULT_REPLAY_TIMEOUT_MS,
    EngineBatch,
    ZmqSubscriber,
    parse_zmq_url,
)

logger = logging.getLogger(__name__)

HEADER_ENGINE = "kvwarm.engine"
HEADER_SEQ = "kvwarm.seq"
HEADER_EVENT_INDEX = "kvwarm.event_index"
HEADER_SYNTHETIC = "kvwarm.synthetic"

DEFAULT_MAX_ROOTS = 2_000_000
"""Block -> root entries the bridge remembers (about 200 MB at the cap); the oldest go
first. A forgotten block's later events are keyed by their own first hash."""


class BridgeUrlError(ValueError):
    """A ``kafka://`` URL cannot be parsed; the message shows the accepted form."""


class BridgeDeliveryError(RuntimeError):
    """Kafka did not acknowledge a step's records after every attempt. Nothing after
    the last saved sequence was lost: restart the bridge with the same ``--state``."""


class RecordSink(Protocol):
    """What the bridge needs from a producer (``serving.kafka_io.KafkaEventProducer``)."""

    def send_record(
        self,
        value: bytes,
        *,
        key: bytes | None = None,
        headers: Sequence[tuple[str, bytes]] = (),
        topic: str | None = None,
        partition: int | None = None,
    ) -> None: ...

    def flush(self, timeout_s: float | None = None) -> None: ...


def parse_kafka_url(url: str) -> tuple[str, str]:
    """``kafka://HOST:PORT[,HOST:PORT...]/TOPIC`` or ``kafka:TOPIC`` (the local broker,
    ``serving.settings.local_bootstrap``) -> (bootstrap, topic)."""
    from serving.settings import SettingsError, parse_sink

    try:
        endpoint = parse_sink(url) if url.startswith("kafka:") else None
    except SettingsError:
        endpoint = None
    if endpoint is None:
        raise BridgeUrlError(
            f"{url!r}: expected kafka://HOST:PORT[,HOST:PORT...]/TOPIC or kafka:TOPIC"
        )
    return endpoint.target, endpoint.topic


class PrefixRoots:
    """Block hash -> root of its chain, bounded (oldest entries forgotten first)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ROOTS) -> None:
        self.max_entries = max_entries
        self._root: dict[int, int] = {}

    def key_of(self, event: ResidencyEvent) -> int | None:
        """The event's prefix root (recording its blocks' roots); ``None`` for a clear."""
        if isinstance(event, AllBlocksCleared) or not event.block_hashes:
            return None
        first = event.block_hashes[0]
        if isinstance(event, BlockStored) and event.num_tokens > 0:
            parent = event.parent_block_hash
            root = first if parent is None else self._root.get(parent, parent)
            for h in event.block_hashes:
                self._root[h] = root
            while len(self._root) > self.max_entries:
                del self._root[next(iter(self._root))]
            return root
        return self._root.get(first, first)

    def __len__(self) -> int:
        return len(self._root)


@dataclass(frozen=True, slots=True)
class _Record:
    value: bytes
    key: bytes | None
    headers: list[tuple[str, bytes]]
    topic: str | None = None
    broadcast: bool = False


def _decode(payload: bytes, engine_id: str) -> tuple[Any, list[Any], list[ResidencyEvent]]:
    """The batch as decoded from msgpack, its raw events (either encoding) and their typed
    form, decoding the bytes once. Raises ``EventValidationError``."""
    try:
        batch = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise EventValidationError("<payload>", f"not msgpack: {exc}", "not_msgpack") from None
    events = kv_events_from_batch(batch, engine_id)  # validates the shape used below
    return batch, list(batch["events"] if isinstance(batch, dict) else batch[1]), events


def _single(batch: Any, raw_event: Any) -> bytes:
    """A batch like ``batch`` holding only ``raw_event``."""
    if isinstance(batch, dict):
        return msgspec.msgpack.encode({**batch, "events": [raw_event]})
    return msgspec.msgpack.encode([batch[0], [raw_event], *batch[2:]])


class Bridge:
    """Forwards an engine stream (``ZmqSubscriber``) into a topic through a ``RecordSink``.

    ``step`` reads up to ``max_batches`` batches and sends their records, flushing as
    described there; the caller loops (``run``), and calls ``flush`` before stopping.
    ``num_partitions`` is the topic's partition count, used to send clears to every
    partition. ``delivered_seq`` (engine id -> last acknowledged batch) starts from the
    subscriber's ``resume_after``.
    """

    def __init__(
        self,
        subscriber: ZmqSubscriber,
        sink: RecordSink,
        *,
        topic: str,
        num_partitions: int,
        dead_letter_topic: str | None = None,
        state_path: str | os.PathLike[str] | None = None,
        max_roots: int = DEFAULT_MAX_ROOTS,
        delivery_attempts: int = 8,
        flush_timeout_s: float = 30.0,
        max_unflushed_records: int = 5_000,
        max_flush_interval_s: float = 0.2,
    ) -> None:
        if num_partitions < 1:
            raise ValueError(f"topic {topic} needs at least one partition, got {num_partitions}")
        self.subscriber = subscriber
        self.sink = sink
        self.topic = topic
        self.num_partitions = num_partitions
        self.dead_letter_topic = dead_letter_topic or topic + DLQ_SUFFIX
        self.state_path = Path(state_path) if state_path else None
        self.delivery_attempts = delivery_attempts
        self.flush_timeout_s = flush_timeout_s
        self.max_unflushed_records = max_unflushed_records
        self.max_flush_interval_s = max_flush_interval_s
        self._unflushed: list[_Record] = []
        self._unflushed_seq: dict[str, int] = {}
        self._resend = False
        self._last_flush_s = time.monotonic()
        self.roots = PrefixRoots(max_roots)
        self.delivered_seq: dict[str, int] = {
            engine_id: stream.last_seq
            for engine_id, stream in subscriber.streams.items()
            if stream.last_seq is not None
        }
        self.num_batches = 0
        self.num_records = 0
        self.num_events = 0
        self.num_restarts = 0
        self.num_delivery_retries = 0
        self.dead_letters_by_reason: Counter[str] = Counter()

    @staticmethod
    def load_state(path: str | os.PathLike[str]) -> dict[str, int]:
        """Last delivered sequence per engine from a state file (empty if none yet)."""
        p = Path(path)
        if not p.is_file():
            return {}
        data = json.loads(p.read_text())
        return {str(k): int(v) for k, v in data.get("delivered_seq", {}).items()}

    def _save_state(self) -> None:
        if self.state_path is None:
            return
        tmp = self.state_path.with_suffix(self.state_path.suffix + ".tmp")
        tmp.write_text(json.dumps({"delivered_seq": self.delivered_seq}))
        os.replace(tmp, self.state_path)  # atomic: a crash leaves the old or the new file

    def _headers(self, batch: EngineBatch, index: int | None) -> list[tuple[str, bytes]]:
        headers = [(HEADER_ENGINE, batch.engine_id.encode()), (HEADER_SEQ, str(batch.seq).encode())]
        if index is not None:
            headers.append((HEADER_EVENT_INDEX, str(index).encode()))
        return headers

    def records(self, batch: EngineBatch) -> list[_Record]:
        """The Kafka records of one engine batch (dead letter included)."""
        out: list[_Record] = []
        if batch.restart:
            self.num_restarts += 1
            cleared = msgspec.msgpack.encode([time.time(), [{"type": "AllBlocksCleared"}]])
            headers = [*self._headers(batch, None), (HEADER_SYNTHETIC, b"restart")]
            out.append(_Record(cleared, batch.engine_id.encode(), headers, broadcast=True))
        try:
            shape, raw_events, events = _decode(batch.payload, batch.engine_id)
        except EventValidationError as exc:
            return [*out, self._dead_letter(batch, exc.reason, str(exc))]
        except Exception as exc:  # a decoder bug must not stop the stream
            logger.exception("unexpected error decoding %s#%d", batch.engine_id, batch.seq)
            return [*out, self._dead_letter(batch, "decoder_error", f"{type(exc).__name__}: {exc}")]
        self.num_events += len(events)
        for index, (event, raw) in enumerate(zip(events, raw_events, strict=True)):
            value = _single(shape, raw)
            headers = self._headers(batch, index)
            root = self.roots.key_of(event)
            if root is None:
                out.append(_Record(value, batch.engine_id.encode(), headers, broadcast=True))
            else:
                out.append(_Record(value, str(root).encode(), headers))
        return out

    def _dead_letter(self, batch: EngineBatch, reason: str, error: str) -> _Record:
        self.dead_letters_by_reason[reason] += 1
        headers = [
            *self._headers(batch, None),
            (HEADER_REASON, reason.encode()),
            (HEADER_ERROR, error[:500].encode()),
        ]
        return _Record(batch.payload, None, headers, topic=self.dead_letter_topic)

    def _send(self, records: list[_Record]) -> None:
        for r in records:
            if r.broadcast:
                for partition in range(self.num_partitions):
                    self.sink.send_record(
                        r.value, key=r.key, headers=r.headers, topic=self.topic, partition=partition
                    )
            else:
                self.sink.send_record(
                    r.value, key=r.key, headers=r.headers, topic=r.topic or self.topic
                )

    def deliver(self, records: list[_Record], *, already_sent: bool = False) -> None:
        """Flush ``records`` (sending them first unless ``already_sent``); on failure send
        everything again (at-least-once: duplicates are possible, losses are not), with
        backoff, at most ``delivery_attempts`` times."""
        for attempt in range(1, self.delivery_attempts + 1):
            try:
                if attempt > 1 or not already_sent:
                    self._send(records)
                self.sink.flush(self.flush_timeout_s)
                return
            except Exception as exc:  # the producer's errors (kafka-python's live in kafka_io)
                if attempt == self.delivery_attempts:
                    raise BridgeDeliveryError(
                        f"{len(records)} records not acknowledged after {attempt} attempts: {exc}"
                    ) from exc
                self.num_delivery_retries += 1
                delay_s = min(5.0, 0.2 * 2 ** (attempt - 1))
                logger.warning(
                    "delivery attempt %d/%d failed (%s); resending in %.1f s",
                    attempt,
                    self.delivery_attempts,
                    exc,
                    delay_s,
                )
                time.sleep(delay_s)

    def step(self, max_batches: int = 256, timeout_ms: int = 100) -> int:
        """Forward what arrived (waiting up to ``timeout_ms`` when nothing is unflushed);
        returns the number of records sent.

        Records go to the producer at once; the flush (waiting for acks) happens when the
        stream is caught up (fewer than ``max_batches`` were waiting), every
        ``max_unflushed_records`` records, or ``max_flush_interval_s``, so a backlog
        is produced in large pipelined runs. Only flushed sequences count as delivered.
        """
        batches = self.subscriber.receive(max_batches, 0 if self._unflushed_seq else timeout_ms)
        records = [r for batch in batches for r in self.records(batch)]
        if records:
            try:
                self._send(records)
            except Exception as exc:  # the flush resends everything unflushed
                self._resend = True
                logger.warning("sending failed (%s); will resend at the flush", exc)
        self._unflushed.extend(records)
        for batch in batches:
            self._unflushed_seq[batch.engine_id] = batch.seq
        self.num_batches += len(batches)
        self.num_records += len(records)
        if self._unflushed_seq and (
            len(batches) < max_batches
            or len(self._unflushed) >= self.max_unflushed_records
            or time.monotonic() - self._last_flush_s >= self.max_flush_interval_s
        ):
            self.flush()
        return len(records)

    def flush(self) -> None:
        """Wait until everything sent is acknowledged, then mark it delivered (and save the
        state file). Raises ``BridgeDeliveryError`` when the attempts run out."""
        if self._unflushed:
            self.deliver(self._unflushed, already_sent=not self._resend)
        self._resend = False
        self.delivered_seq.update(self._unflushed_seq)
        self._unflushed = []
        self._unflushed_seq = {}
        self._last_flush_s = time.monotonic()
        self._save_state()

    def run(
        self,
        *,
        duration_s: float | None = None,
        max_batches: int | None = None,
        report_every_s: float = 10.0,
    ) -> None:
        """Loop ``step`` until ``duration_s`` passed or ``max_batches`` were forwarded,
        then flush."""
        start = last_report = time.monotonic()
        while True:
            now = time.monotonic()
            if duration_s is not None and now - start >= duration_s:
                break
            if max_batches is not None and self.num_batches >= max_batches:
                break
            self.step()
            if now - last_report >= report_every_s:
                last_report = now
                logger.info("bridge: %s", json.dumps(self.stats()))
        self.flush()

    def stats(self) -> dict[str, Any]:
        return {
            "batches": self.num_batches,
            "events": self.num_events,
            "records": self.num_records,
            "restarts": self.num_restarts,
            "delivery_retries": self.num_delivery_retries,
            "dead_letters_by_reason": dict(self.dead_letters_by_reason),
            "roots": len(self.roots),
            "delivered_seq": dict(self.delivered_seq),
            **self.subscriber.stats(),
        }


@click.command("bridge")
@click.option(
    "--from",
    "sources",
    required=True,
    multiple=True,
    help="zmq://HOST:PORT[?topic=T&replay=tcp://HOST:PORT&engine=ID]; repeat for more engines.",
)
@click.option(
    "--to",
    "sink_url",
    default=f"kafka:{DEFAULT_EVENTS_TOPIC}",
    show_default=True,
    help="kafka:TOPIC (the local broker: $KVWARM_KAFKA_BOOTSTRAP, else the address "
    "`kvwarm kafka up` wrote, else 127.0.0.1:9092) or kafka://HOST:PORT/TOPIC.",
)
@click.option("--dead-letter-topic", default=None, help="Default: TOPIC.dlq")
@click.option(
    "--partitions",
    default=12,
    show_default=True,
    type=click.IntRange(1),
    help="Partitions for TOPIC if the bridge creates it.",
)
@click.option(
    "--state",
    "state_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="File keeping the last delivered sequence per engine, to resume from replay.",
)
@click.option("--replay-timeout-ms", default=DEFAULT_REPLAY_TIMEOUT_MS, show_default=True)
@click.option(
    "--duration-s",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="Stop after this long (seconds).",
)
@click.option(
    "--max-batches", type=click.IntRange(1), default=None, help="Stop after this many batches."
)
def bridge(
    sources: tuple[str, ...],
    sink_url: str,
    dead_letter_topic: str | None,
    partitions: int,
    state_path: Path | None,
    replay_timeout_ms: int,
    duration_s: float | None,
    max_batches: int | None,
) -> None:
    """Forward vLLM/SGLang KV events from ZMQ publishers into a Kafka topic."""
    from serving.kafka_io import (
        KafkaEventProducer,
        KafkaUnavailableError,
        ensure_topics,
        topic_partitions,
    )

    try:
        engines = parse_zmq_url(list(sources))
        bootstrap, topic = parse_kafka_url(sink_url)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    dlq = dead_letter_topic or topic + DLQ_SUFFIX
    try:
        ensure_topics(bootstrap, {topic: partitions, dlq: 1})
        num_partitions = topic_partitions(bootstrap, topic)
    except KafkaUnavailableError as exc:
        raise click.ClickException(str(exc)) from None
    resume_after = Bridge.load_state(state_path) if state_path is not None else {}
    subscriber = ZmqSubscriber(
        engines, replay_timeout_ms=replay_timeout_ms, resume_after=resume_after
    )
    producer = KafkaEventProducer(bootstrap, topic, client_id="kvwarm-bridge")
    runner = Bridge(
        subscriber,
        producer,
        topic=topic,
        num_partitions=num_partitions,
        dead_letter_topic=dlq,
        state_path=state_path,
    )
    click.echo(
        f"bridging {', '.join(e.engine_id for e in engines)} -> {bootstrap}/{topic} "
        f"({num_partitions} partitions, dead letters to {dlq})",
        err=True,
    )
    try:
        runner.run(duration_s=duration_s, max_batches=max_batches)
    except KeyboardInterrupt:
        runner.flush()  # what was sent is acknowledged (and saved) before exiting
    finally:
        subscriber.close()
        producer.close()
        click.echo(json.dumps(runner.stats(), indent=2))
