"""``kvwarm bench zmq``: events per second decoded from a live ZMQ stream, and through the
bridge into Kafka when a broker is given, against decoding the same payloads from memory
in the same process.

The engine side lives here too: ``EnginePublisher`` binds a real PUB socket and a ROUTER
replay socket and speaks vLLM's protocol (``vllm/distributed/kv_events.py``:
``[topic, seq, payload]`` live; ``["", start_seq]`` -> ``[seq, payload]``... ``[-1, ""]``
replay), with payloads built from msgspec Structs declared exactly as vLLM declares them
(``vllm_structs``), in both encodings. The benchmark and the tests use it as the engine.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click
import msgspec
import zmq

# --- vLLM's KV event structs (both encodings) ---------------------------------------------


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class VllmStructs:
    """The event classes of one encoding. ``array_like=False`` is current vLLM (tagged
    maps); ``array_like=True`` is older releases and the example subscriber
    (positional arrays)."""

    BlockStored: type[msgspec.Struct]
    BlockRemoved: type[msgspec.Struct]
    AllBlocksCleared: type[msgspec.Struct]
    KVEventBatch: type[EventBatch]

    def stored(
        self,
        hashes: list[Any],
        parent: Any = None,
        medium: str | None = "GPU",
        tokens: bool = True,
        block_size: int = 16,
    ) -> msgspec.Struct:
        """A ``BlockStored`` as vLLM fills it; ``tokens=False`` gives the tokenless form
        offload tiers send (no token ids, block size 0)."""
        return self.BlockStored(  # type: ignore[call-arg]
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=list(range(block_size * len(hashes))) if tokens else [],
            block_size=block_size if tokens else 0,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )


def vllm_structs(array_like: bool) -> VllmStructs:
    """Declare vLLM's ``KVCacheEvent`` family with the given encoding."""

    class KVCacheEvent(
        msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True
    ):  # type: ignore[call-arg]
        """Base class for all KV cache-related events."""

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return VllmStructs(BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch)


TAGGED = vllm_structs(array_like=False)
POSITIONAL = vllm_structs(array_like=True)
_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: msgspec.Struct) -> bytes:
    return _encoder.encode(batch)


# --- the engine publisher ------------------------------------------------------------------

_END_SEQ_BYTES = (-1).to_bytes(8, "big", signed=True)


def _bind_again(sock: zmq.Socket[bytes], address: str, timeout_s: float = 5.0) -> None:
    # A closed socket releases its port in ZMQ's I/O thread, a moment after close().
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.bind(address)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class EnginePublisher:
    """A vLLM-style KV event publisher on 127.0.0.1 ephemeral ports.

    ``publish`` numbers batches from 0, keeps the last ``buffer_steps`` for replay and
    sends them on the PUB socket; ``drop=True`` numbers and buffers a batch without
    sending it (a message lost on the wire). ``forget`` removes a batch from the replay
    buffer (lost for good). ``restart`` closes both sockets and binds the same ports
    again with the sequence back at 0, as a restarted engine does. A thread serves the
    ROUTER socket; the PUB socket belongs to the caller's thread.
    """

    def __init__(
        self,
        *,
        topic: str = "",
        replay: bool = True,
        buffer_steps: int = 10_000,
        host: str = "127.0.0.1",
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.topic = topic
        self._ctx = context or zmq.Context.instance()
        self._host = host
        self._with_replay = replay
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self.next_seq = 0
        self.port: int | None = None
        self.replay_port: int | None = None
        self.num_replay_requests = 0
        self._bind()

    def _bind(self) -> None:
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        if self.port is None:
            self.port = self._pub.bind_to_random_port(f"tcp://{self._host}")
        else:
            _bind_again(self._pub, f"tcp://{self._host}:{self.port}")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._with_replay:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            if self.replay_port is None:
                self.replay_port = router.bind_to_random_port(f"tcp://{self._host}")
            else:
                _bind_again(router, f"tcp://{self._host}:{self.replay_port}")
            self._thread = threading.Thread(
                target=self._serve_replay, args=(router,), name="engine-replay", daemon=True
            )
            self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://{self._host}:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://{self._host}:{self.replay_port}" if self._with_replay else None

    def url(self, engine_id: str | None = None) -> str:
        """The ``zmq://`` source URL for this publisher."""
        params = []
        if self.topic:
            params.append(f"topic={self.topic}")
        if self._with_replay:
            params.append(f"replay={self.replay_endpoint}")
        if engine_id:
            params.append(f"engine={engine_id}")
        query = ("?" + "&".join(params)) if params else ""
        return f"zmq://{self._host}:{self.port}{query}"

    def publish_payload(self, payload: bytes, *, drop: bool = False) -> int:
        seq = self.next_seq
        self.next_seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        if not drop:
            self._pub.send_multipart([self.topic.encode(), seq.to_bytes(8, "big"), payload])
        return seq

    def send_frames(self, frames: list[bytes]) -> None:
        """Send raw multipart frames, outside the numbering (malformed-input tests)."""
        self._pub.send_multipart(frames)

    def publish(self, batch: msgspec.Struct, *, drop: bool = False) -> int:
        return self.publish_payload(encode_batch(batch), drop=drop)

    def heartbeat(self) -> int:
        """An empty batch, as idle vLLM publishers send."""
        return self.publish(TAGGED.KVEventBatch(ts=time.time(), events=[]))

    def forget(self, seq: int) -> None:
        with self._lock:
            self._buffer = deque(
                ((s, p) for s, p in self._buffer if s != seq), maxlen=self._buffer.maxlen
            )

    def heartbeat_until(self, ready: Callable[[], bool], timeout_s: float = 5.0) -> None:
        """Send heartbeats until ``ready()`` (ZMQ's slow joiner: a SUB sees nothing sent
        before its subscription reached the PUB). Raises ``TimeoutError``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.heartbeat()
            if ready():
                return
            time.sleep(0.01)
        raise TimeoutError(f"no subscriber confirmed {self.endpoint} within {timeout_s} s")

    def _serve_replay(self, router: zmq.Socket[bytes]) -> None:
        try:
            while not self._stop.is_set():
                if not router.poll(20):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3:
                    continue
                client_id, _, start_bytes = frames
                start = int.from_bytes(start_bytes, "big")
                self.num_replay_requests += 1
                with self._lock:
                    buffered = [(s, p) for s, p in self._buffer if s >= start]
                for seq, payload in buffered:
                    router.send_multipart([client_id, b"", seq.to_bytes(8, "big"), payload])
                router.send_multipart([client_id, b"", _END_SEQ_BYTES, b""])
        finally:
            router.close(linger=0)

    def _unbind(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pub.close(linger=0)

    def restart(self) -> None:
        """Come back as a new engine process on the same ports."""
        self._unbind()
        with self._lock:
            self._buffer.clear()
        self.next_seq = 0
        self._bind()

    def close(self) -> None:
        self._unbind()

    def __enter__(self) -> EnginePublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the benchmark ----------------------------------------------------------------------------

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
    from serving.kafka_broker import KafkaBroker, default_state_dir

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
