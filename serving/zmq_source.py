"""Live KV events from vLLM / SGLang engines over ZMQ.

An engine started with ``--kv-events-config '{"publisher": "zmq", ...}'`` binds a PUB
socket that sends multipart ``[topic, seq, payload]`` (``seq``: 8-byte big-endian batch
number, counting from 0 per engine process; ``payload``: a msgpack ``KVEventBatch``) and,
optionally, a ROUTER replay socket that re-sends buffered batches from a start sequence.

Primitives:

- ``parse_zmq_url(url)``: ``zmq://HOST:PORT[?topic=T&replay=tcp://HOST:PORT&engine=ID]``
  to a list of ``EngineEndpoint`` (several engines: comma-separated hosts, with
  ``replay`` / ``engine`` repeated or comma-separated in the same order).
- ``ZmqSubscriber``: raw batches per engine in sequence order. It fills sequence gaps
  from the replay endpoint (counting those it could not fill) and flags the first batch
  after an engine restart (sequence went back). The bridge uses it directly.
- ``Residency``: one engine's view of which tiers hold each block, plus the prefix links
  (block -> parent, block -> root) its stored events reported.
- ``ZmqEventSource``: the ``EventSource`` of the sidecar. Decodes batches into the typed
  events, keeps one ``Residency`` per engine, counts bad input by reason.

ZMQ PUB/SUB has no offsets and no acknowledgements: a slow subscriber loses messages at
its high-water mark, and the sequence numbers plus the replay buffer are what make the
stream whole again. Nothing here blocks longer than ``timeout_ms`` plus one bounded replay
round trip (``replay_timeout_ms``) per gap.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import zmq

from features.decoders import MAX_MESSAGE_BYTES, RejectLog, decode_kv_event_batch
from features.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventValidationError,
    ResidencyEvent,
    Tier,
)
from serving.sources import record_dead_letter

logger = logging.getLogger(__name__)

END_SEQ = -1
"""Sequence number of the replay socket's end-of-replay frame."""

DEFAULT_RCV_HWM = 100_000
"""Receive high-water mark (messages) per engine; vLLM's publisher uses the same default."""

DEFAULT_REPLAY_TIMEOUT_MS = 1_000
"""How long one gap fill waits for the replay socket. vLLM services replay requests
between publishing steps (a 100 ms idle poll), so a second is generous."""

_SEQ_FRAME_BYTES = (8, 24)  # 8: seq; 24: seq + 16-byte publisher id (newer vLLM)

MAX_SEQ_JUMP = 1_000_000
"""A batch numbered further than this ahead of the last one is held, not trusted: one
absurd sequence number (a corrupt frame) would otherwise make every later batch look
like an engine restart and wipe that engine's residency. The jump is accepted when the
next batch follows on from the held one (a real long outage); otherwise the held
batch is dropped and counted as ``bad_frames["seq_jump"]``."""


class ZmqUrlError(ValueError):
    """A ``zmq://`` source URL cannot be parsed; the message shows the accepted form."""


_URL_FORM = "zmq://HOST:PORT[,HOST:PORT...][?topic=T&replay=tcp://HOST:PORT[,...]&engine=ID[,...]]"


@dataclass(frozen=True, slots=True)
class EngineEndpoint:
    """Where one engine publishes. ``engine_id`` names it in events, metrics and Kafka
    headers (default ``HOST:PORT``)."""

    engine_id: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def _split_values(values: Iterable[str]) -> list[str]:
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _tcp(address: str, what: str, url: str) -> str:
    if "://" not in address:
        address = f"tcp://{address}"
    parts = urlsplit(address)
    if parts.scheme not in ("tcp", "ipc", "inproc"):
        raise ZmqUrlError(f"{what} {address!r} in {url!r}: use tcp://HOST:PORT; form: {_URL_FORM}")
    if parts.scheme == "tcp":
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise ZmqUrlError(f"{what} {address!r} in {url!r} needs HOST:PORT; form: {_URL_FORM}")
    return address


def parse_zmq_url(url: str | Sequence[str]) -> list[EngineEndpoint]:
    """Parse one source URL (or several) into engine endpoints.

    ``zmq://h1:5557,h2:5557?replay=tcp://h1:5558,tcp://h2:5558&engine=a,b&topic=kv``
    names two engines; ``replay`` and ``engine`` pair with hosts by position (give none,
    or one per host). ``topic`` applies to every engine of the URL.
    """
    urls = [url] if isinstance(url, str) else list(url)
    engines: list[EngineEndpoint] = []
    for one in urls:
        for chunk in one.split():
            engines.extend(_parse_one(chunk))
    ids = [e.engine_id for e in engines]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ZmqUrlError(
            f"engine ids must be unique, repeated: {duplicates}; name them with engine="
        )
    if not engines:
        raise ZmqUrlError(f"no engine in {url!r}; form: {_URL_FORM}")
    return engines


def _parse_one(url: str) -> list[EngineEndpoint]:
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != "zmq":
        raise ZmqUrlError(f"{url!r} is not a zmq:// URL; form: {_URL_FORM}")
    hosts_part, _, query = rest.partition("?")
    hosts = [h.strip() for h in hosts_part.rstrip("/").split(",") if h.strip()]
    if not hosts:
        raise ZmqUrlError(f"{url!r} names no HOST:PORT; form: {_URL_FORM}")
    params = parse_qs(query, keep_blank_values=True)
    unknown = sorted(set(params) - {"topic", "replay", "engine"})
    if unknown:
        raise ZmqUrlError(f"unknown parameters {unknown} in {url!r}; valid: topic, replay, engine")
    topics = params.get("topic", [""])
    if len(topics) > 1:
        raise ZmqUrlError(f"give topic= once per URL in {url!r}")
    replays = _split_values(params.get("replay", []))
    names = _split_values(params.get("engine", []))
    for label, values in (("replay", replays), ("engine", names)):
        if values and len(values) != len(hosts):
            raise ZmqUrlError(
                f"{len(values)} {label} value(s) for {len(hosts)} host(s) in {url!r}; "
                f"give one per host, in the same order"
            )
    out = []
    for i, host in enumerate(hosts):
        endpoint = _tcp(host, "endpoint", url)
        out.append(
            EngineEndpoint(
                engine_id=names[i] if names else host,
                endpoint=endpoint,
                replay_endpoint=_tcp(replays[i], "replay endpoint", url) if replays else None,
                topic=topics[0],
            )
        )
    return out


# --- transport: sequence order, gaps, restarts -----------------------------------------


@dataclass(frozen=True, slots=True)
class EngineBatch:
    """One ``KVEventBatch`` payload as the engine numbered it.

    ``restart`` is set on the first batch after the engine's sequence went back (a new
    engine process): whatever was known about that engine before is stale.
    """

    engine_id: str
    seq: int
    payload: bytes
    replayed: bool = False
    restart: bool = False


@dataclass
class EngineStreamStats:
    """Where one engine's stream stands (``last_seq``, ``publisher_id``) and its counters
    (monotonic)."""

    last_seq: int | None = None
    publisher_id: bytes | None = None
    num_batches: int = 0
    num_gaps: int = 0
    num_replayed: int = 0
    num_unfilled: int = 0
    num_restarts: int = 0
    held: tuple[int, bytes] | None = None
    """A batch that jumped more than ``MAX_SEQ_JUMP`` ahead, until the next one says
    whether the jump was real."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "last_seq": self.last_seq,
            "batches": self.num_batches,
            "gaps": self.num_gaps,
            "replayed": self.num_replayed,
            "unfilled": self.num_unfilled,
            "restarts": self.num_restarts,
        }


class ZmqSubscriber:
    """SUB sockets to one or more engine publishers; yields ``EngineBatch`` in order.

    When a sequence number skips ahead, the missing batches are requested from the
    engine's replay endpoint (DEALER -> ROUTER: ``["", start_seq]``; replies
    ``["", (topic,) seq, payload]`` until ``seq == -1``) and returned before the batch
    that revealed the gap; those it cannot get are counted in ``num_unfilled``. When the
    sequence goes back (or the publisher id of a 24-byte sequence frame changes), the
    engine restarted: the next batch carries ``restart=True`` and the new process's
    batches from 0 are requested from replay. Malformed frames are counted by reason.

    Limit: with 8-byte sequence frames a restart is seen only when the sequence goes
    back; a new process first heard of beyond the old ``last_seq`` (a long outage) looks
    like a gap. Publishers with 24-byte frames (a publisher id) are always caught.
    """

    def __init__(
        self,
        engines: Sequence[EngineEndpoint],
        *,
        replay_timeout_ms: int = DEFAULT_REPLAY_TIMEOUT_MS,
        rcv_hwm: int = DEFAULT_RCV_HWM,
        context: zmq.Context[Any] | None = None,
        resume_after: Mapping[str, int] | None = None,
    ) -> None:
        """``resume_after``: engine id -> last sequence already handled by a previous
        run; what the engine published since is requested from its replay buffer."""
        if not engines:
            raise ValueError("ZmqSubscriber needs at least one engine endpoint")
        self.engines = list(engines)
        self.replay_timeout_ms = replay_timeout_ms
        self._ctx = context or zmq.Context.instance()
        self._subs: dict[str, zmq.Socket[bytes]] = {}
        self._replays: dict[str, zmq.Socket[bytes]] = {}
        self.streams: dict[str, EngineStreamStats] = {}
        self.bad_frames: Counter[str] = Counter()
        self._poller = zmq.Poller()
        self._monitors: dict[str, zmq.Socket[bytes]] = {}
        self.connected: set[str] = set()
        """Engines whose publisher socket is connected now (updated by ``receive``)."""
        for engine in self.engines:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, rcv_hwm)
            # A frame over the decoders' bound is refused by libzmq before it is buffered
            # (the peer is disconnected and reconnects), so no message costs more memory.
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.SUBSCRIBE, engine.topic.encode())
            # Connection events of this socket, read in ``receive`` (the loop's thread).
            self._monitors[engine.engine_id] = sock.get_monitor_socket(
                zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
            )
            sock.connect(engine.endpoint)
            self._subs[engine.engine_id] = sock
            self._poller.register(sock, zmq.POLLIN)
            self.streams[engine.engine_id] = EngineStreamStats(
                last_seq=(resume_after or {}).get(engine.engine_id)
            )
        self._closed = False
        # Sockets left to the garbage collector close in any order, a monitored socket
        # before its monitor is disabled; with libzmq 4.3 that left the shared context
        # unable to deliver to any later subscriber (seen in tests, 2 runs in 5). The
        # finalizer holds the sockets and closes them in order if ``close`` was never called.
        self._finalizer = weakref.finalize(
            self, _close_sockets, self._subs, self._monitors, self._replays
        )

    def receive(self, max_batches: int, timeout_ms: int) -> list[EngineBatch]:
        """Up to about ``max_batches`` batches (a gap fill may add its batches at once),
        waiting at most ``timeout_ms`` for the first one."""
        if self._closed:
            return []
        self._track_connections()
        out: list[EngineBatch] = []
        self._drain(out, max_batches)
        if not out and timeout_ms > 0 and self._poller.poll(timeout_ms):
            self._drain(out, max_batches)
        return out

    def _track_connections(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        for engine_id, monitor in self._monitors.items():
            while True:
                try:
                    event = recv_monitor_message(monitor, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if event["event"] == zmq.EVENT_CONNECTED:
                    self.connected.add(engine_id)
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    self.connected.discard(engine_id)

    def _drain(self, out: list[EngineBatch], max_batches: int) -> None:
        # Round robin so a busy engine cannot starve the others.
        progress = True
        while progress and len(out) < max_batches:
            progress = False
            for engine in self.engines:
                try:
                    frames = self._subs[engine.engine_id].recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                progress = True
                out.extend(self._accept(engine, frames))
                if len(out) >= max_batches:
                    return

    def _accept(self, engine: EngineEndpoint, frames: list[bytes]) -> list[EngineBatch]:
        if len(frames) != 3:
            self.bad_frames["bad_frame_count"] += 1
            return []
        _topic, seq_frame, payload = frames
        if len(seq_frame) not in _SEQ_FRAME_BYTES:
            self.bad_frames["bad_seq_frame"] += 1
            return []
        seq = int.from_bytes(seq_frame[:8], "big", signed=True)
        if seq < 0:
            self.bad_frames["negative_seq"] += 1
            return []
        stream = self.streams[engine.engine_id]
        publisher_id = seq_frame[8:] or None
        new_publisher = publisher_id is not None and stream.publisher_id not in (
            None,
            publisher_id,
        )
        out: list[EngineBatch] = []
        held, stream.held = stream.held, None
        if held is not None and seq == held[0] + 1 and not new_publisher:
            # The batch after a held far jump follows on from it: the jump was real.
            assert stream.last_seq is not None
            stream.num_gaps += 1
            stream.num_unfilled += held[0] - stream.last_seq - 1
            logger.warning(
                "engine %s: sequence jumped from %d to %d; the batches between are lost",
                engine.engine_id,
                stream.last_seq,
                held[0],
            )
            out.append(EngineBatch(engine.engine_id, held[0], held[1]))
            stream.last_seq = held[0]
        elif held is not None:
            self.bad_frames["seq_jump"] += 1
        if (
            stream.last_seq is not None
            and seq > stream.last_seq + MAX_SEQ_JUMP
            and not new_publisher
        ):
            stream.held = (seq, payload)
            return out
        restart = stream.last_seq is not None and (seq <= stream.last_seq or new_publisher)
        if restart:
            stream.num_restarts += 1
            logger.warning(
                "engine %s restarted (sequence %d after %s); its residency is reset",
                engine.engine_id,
                seq,
                stream.last_seq,
            )
            # The new process numbers from 0: what came before `seq` is a gap to fill.
            stream.last_seq = -1
        stream.publisher_id = publisher_id
        if stream.last_seq is not None and seq > stream.last_seq + 1:
            out.extend(self._fill_gap(engine, stream.last_seq + 1, seq))
        out.append(EngineBatch(engine.engine_id, seq, payload))
        if restart:
            first = out[0]
            out[0] = EngineBatch(first.engine_id, first.seq, first.payload, first.replayed, True)
        stream.num_batches += len(out)
        stream.last_seq = seq
        return out

    def _replay_socket(self, engine: EngineEndpoint) -> zmq.Socket[bytes]:
        sock = self._replays.get(engine.engine_id)
        if sock is None:
            assert engine.replay_endpoint is not None
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.connect(engine.replay_endpoint)
            self._replays[engine.engine_id] = sock
        return sock

    def _drop_replay_socket(self, engine_id: str) -> None:
        # A fresh socket next time: replies still in flight for this one are discarded
        # (the engine's ROUTER drops messages for peers that went away).
        sock = self._replays.pop(engine_id, None)
        if sock is not None:
            sock.close(linger=0)

    def _fill_gap(self, engine: EngineEndpoint, start: int, stop: int) -> list[EngineBatch]:
        """Fetch batches ``start .. stop-1`` from the engine's replay endpoint."""
        stream = self.streams[engine.engine_id]
        stream.num_gaps += 1
        missing = stop - start
        got: dict[int, bytes] = {}
        if engine.replay_endpoint is not None:
            sock = self._replay_socket(engine)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_ms / 1000
            complete = False
            while len(got) < missing:
                remaining_ms = int((deadline - time.monotonic()) * 1000)
                if remaining_ms <= 0 or not sock.poll(remaining_ms):
                    break
                frames = sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) < 2 or len(frames[-2]) not in _SEQ_FRAME_BYTES:
                    self.bad_frames["bad_replay_frame"] += 1
                    continue
                replay_seq = int.from_bytes(frames[-2][:8], "big", signed=True)
                if replay_seq == END_SEQ:
                    complete = True
                    break
                if start <= replay_seq < stop:
                    got[replay_seq] = frames[-1]
            if not complete:
                # Timed out, or got everything before the end marker: stop reading.
                self._drop_replay_socket(engine.engine_id)
        unfilled = missing - len(got)
        stream.num_replayed += len(got)
        stream.num_unfilled += unfilled
        if unfilled:
            logger.warning(
                "engine %s: %d of %d missing batches (seq %d..%d) could not be replayed%s",
                engine.engine_id,
                unfilled,
                missing,
                start,
                stop - 1,
                "" if engine.replay_endpoint else " (no replay endpoint configured)",
            )
        return [EngineBatch(engine.engine_id, s, got[s], replayed=True) for s in sorted(got)]

    def stats(self) -> dict[str, Any]:
        return {
            "engines": {eid: s.as_dict() for eid, s in self.streams.items()},
            "bad_frames": dict(self.bad_frames),
        }

    def close(self) -> None:
        """Close every socket; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.connected.clear()
        self._finalizer()


def _close_sockets(
    subs: dict[str, zmq.Socket[bytes]],
    monitors: dict[str, zmq.Socket[bytes]],
    replays: dict[str, zmq.Socket[bytes]],
) -> None:
    """Each subscriber's monitor is disabled and closed before the subscriber itself."""
    for engine_id, sock in subs.items():
        sock.disable_monitor()
        monitors[engine_id].close(linger=0)
        sock.close(linger=0)
    for sock in replays.values():
        sock.close(linger=0)
    replays.clear()


# --- residency --------------------------------------------------------------------------

_TIER_BITS = {tier: 1 << tier.rank for tier in Tier}
_TIER_SETS = [
    frozenset(t for t, bit in _TIER_BITS.items() if mask & bit) for mask in range(1 << len(Tier))
]
_FASTEST = [min(s, key=lambda t: t.rank) if s else None for s in _TIER_SETS]


@dataclass
class Residency:
    """One engine's residency: which tiers hold each block, and its prefix links.

    ``BlockStored`` with tokens adds the tier and records ``parent`` (the event's
    ``parent_block_hash`` for its first block, the previous block for the rest) and
    ``root`` (the first block of the chain as far as known). A tokenless ``BlockStored``
    (offload tiers, snapshots) is a location update: it adds the tier and leaves the
    links alone; one for a hash never seen is still recorded, and counted.
    ``BlockRemoved`` drops the tier; a block in no tier is forgotten with its links.
    ``AllBlocksCleared`` forgets everything.
    """

    num_location_updates: int = 0
    num_unknown_location_updates: int = 0
    _tiers: dict[int, int] = field(default_factory=dict, repr=False)
    _parent: dict[int, int] = field(default_factory=dict, repr=False)
    _root: dict[int, int] = field(default_factory=dict, repr=False)

    def apply(self, event: ResidencyEvent) -> None:
        """Update the view with one residency event of this engine."""
        if isinstance(event, BlockStored):
            bit = _TIER_BITS[event.tier]
            tiers = self._tiers
            if event.num_tokens == 0:
                self.num_location_updates += 1
                for h in event.block_hashes:
                    if h not in tiers:
                        self.num_unknown_location_updates += 1
                    tiers[h] = tiers.get(h, 0) | bit
                return
            parent = event.parent_block_hash
            root = None if parent is None else self._root.get(parent, parent)
            for h in event.block_hashes:
                tiers[h] = tiers.get(h, 0) | bit
                if parent is not None:
                    self._parent[h] = parent
                self._root[h] = root if root is not None else h
                if root is None:
                    root = h
                parent = h
        elif isinstance(event, BlockRemoved):
            bit = _TIER_BITS[event.tier]
            for h in event.block_hashes:
                mask = self._tiers.get(h)
                if mask is None:
                    continue
                mask &= ~bit
                if mask:
                    self._tiers[h] = mask
                else:
                    del self._tiers[h]
                    self._parent.pop(h, None)
                    self._root.pop(h, None)
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def clear(self) -> None:
        self._tiers.clear()
        self._parent.clear()
        self._root.clear()

    def tiers(self, block_hash: int) -> frozenset[Tier]:
        """The tiers holding ``block_hash`` (empty when none)."""
        return _TIER_SETS[self._tiers.get(block_hash, 0)]

    def fastest_tier(self, block_hash: int) -> Tier | None:
        return _FASTEST[self._tiers.get(block_hash, 0)]

    def parent(self, block_hash: int) -> int | None:
        return self._parent.get(block_hash)

    def root(self, block_hash: int) -> int | None:
        """First block of ``block_hash``'s chain as reported; ``None`` if no link is known."""
        return self._root.get(block_hash)

    def num_in(self, tier: Tier) -> int:
        bit = _TIER_BITS[tier]
        return sum(1 for mask in self._tiers.values() if mask & bit)

    def snapshot(self) -> dict[int, frozenset[Tier]]:
        """A copy of block -> tiers (for comparisons and reports; O(blocks))."""
        return {h: _TIER_SETS[m] for h, m in self._tiers.items()}

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._tiers

    def __len__(self) -> int:
        return len(self._tiers)


# --- the sidecar source -----------------------------------------------------------------


class ZmqEventSource:
    """``EventSource`` over live engine publishers (see ``serving.sources``).

    ``poll`` returns decoded residency events (``engine_id`` set to the engine's name)
    oldest first per engine. After an engine restart the source resets that engine's
    ``Residency`` and emits a synthetic ``AllBlocksCleared`` for it before the new
    process's events, so downstream state resets too. Undecodable batches are counted in
    ``rejects`` by reason (``not_msgpack``, ``unknown_tag``, ``bad_type``, ``bad_hash``,
    ...) and written to ``rejects_path`` when given; a batch is one engine step, so a
    bad event rejects its whole batch, never its neighbours.

    The residency view is updated as batches are decoded, so it can be ahead of what
    ``poll`` has returned by at most the events still buffered (``num_pending``).
    ``commit`` does nothing: ZMQ has no offsets (the replay buffer is the recovery path).
    """

    def __init__(
        self,
        engines: str | Sequence[str] | Sequence[EngineEndpoint],
        *,
        replay_timeout_ms: int = DEFAULT_REPLAY_TIMEOUT_MS,
        rcv_hwm: int = DEFAULT_RCV_HWM,
        rejects_path: str | Path | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if isinstance(engines, str) or (engines and isinstance(engines[0], str)):
            endpoints = parse_zmq_url(engines)  # type: ignore[arg-type]
        else:
            endpoints = list(engines)  # type: ignore[arg-type]
        self.subscriber = ZmqSubscriber(
            endpoints, replay_timeout_ms=replay_timeout_ms, rcv_hwm=rcv_hwm, context=context
        )
        self.rejects = RejectLog(path=Path(rejects_path) if rejects_path else None)
        self._residency = {e.engine_id: Residency() for e in endpoints}
        self._pending: deque[Event] = deque()
        self.num_events = 0
        self.num_batches = 0
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> ZmqEventSource:
        return cls(parse_zmq_url(url), **kwargs)

    @property
    def engine_ids(self) -> list[str]:
        return list(self._residency)

    def residency(self, engine_id: str) -> Residency:
        """The live view of one engine (the same object across calls)."""
        try:
            return self._residency[engine_id]
        except KeyError:
            raise KeyError(f"unknown engine {engine_id!r}; engines: {self.engine_ids}") from None

    def tiers(self, block_hash: int) -> frozenset[Tier]:
        """Tiers holding ``block_hash`` on any engine."""
        out: frozenset[Tier] = frozenset()
        for view in self._residency.values():
            out |= view.tiers(block_hash)
        return out

    def fastest_tier(self, block_hash: int) -> Tier | None:
        tiers = self.tiers(block_hash)
        return min(tiers, key=lambda t: t.rank) if tiers else None

    @property
    def exhausted(self) -> bool:
        """A live stream ends only when closed."""
        return self._closed

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def poll(self, max_events: int, timeout_ms: int = 0) -> list[Event]:
        wait_ms = timeout_ms
        while len(self._pending) < max_events:
            batches = self.subscriber.receive(
                max_batches=max(1, max_events // 16), timeout_ms=wait_ms
            )
            if not batches:
                break
            wait_ms = 0
            for batch in batches:
                self._decode(batch)
        n = min(max_events, len(self._pending))
        out = [self._pending.popleft() for _ in range(n)]
        self.num_events += n
        return out

    def _decode(self, batch: EngineBatch) -> None:
        self.num_batches += 1
        view = self._residency[batch.engine_id]
        if batch.restart:
            view.clear()
            self._pending.append(
                AllBlocksCleared(ts_ms=int(time.time() * 1000), engine_id=batch.engine_id)
            )
        try:
            events = decode_kv_event_batch(batch.payload, engine_id=batch.engine_id)
        except EventValidationError as exc:
            self.rejects.add(f"{batch.engine_id}#{batch.seq}", exc, batch.payload.hex())
            return
        except Exception as exc:  # a decoder bug must not stop the stream either
            logger.exception("unexpected error decoding %s#%d", batch.engine_id, batch.seq)
            error = EventValidationError(
                "<payload>", f"{type(exc).__name__}: {exc}", "decoder_error"
            )
            self.rejects.add(f"{batch.engine_id}#{batch.seq}", error, batch.payload.hex())
            return
        for event in events:
            view.apply(event)
        self._pending.extend(events)

    def commit(self) -> None:
        """ZMQ has no offsets to commit."""

    def dead_letter(self, event: Event, reason: str, error: str) -> None:
        """The loop could not handle ``event``: count it and keep it in the rejects file."""
        engine_id = getattr(event, "engine_id", "")
        record_dead_letter(self.rejects, f"{engine_id}:event", event, reason, error)

    @property
    def ready(self) -> bool:
        """At least one engine's publisher is connected (``/readyz``); read from any
        thread, updated by ``poll``."""
        return not self._closed and bool(self.subscriber.connected)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.subscriber.close()
        self.rejects.close()

    def stats(self) -> dict[str, Any]:
        sub = self.subscriber.stats()
        for engine_id, view in self._residency.items():
            sub["engines"][engine_id]["blocks"] = len(view)
        return {
            "events": self.num_events,
            "batches": self.num_batches,
            "rejects": self.rejects.total,
            "rejects_by_reason": dict(self.rejects.counts),
            "bad_frames": sub["bad_frames"],
            "engines": sub["engines"],
        }
