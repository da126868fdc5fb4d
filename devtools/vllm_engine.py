"""A stand-in for a vLLM engine's KV event publisher, for tests, demos and benchmarks.

``EnginePublisher`` binds a real PUB socket and a ROUTER replay socket and speaks vLLM's
protocol (``vllm/distributed/kv_events.py``: ``[topic, seq, payload]`` live;
``["", start_seq]`` -> ``[seq, payload]``... ``[-1, ""]`` replay), with payloads built
from msgspec Structs declared exactly as vLLM declares them (``vllm_structs``), in both
encodings. ``kvwarm bench zmq`` and the ZMQ tests use it as the engine.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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

    def heartbeat_until(self, ready: Callable[[], bool], timeout_s: float = 30.0) -> None:
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
