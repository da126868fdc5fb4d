"""Sidecar state that survives restarts and rebalances: snapshots kept in a changelog.

Primitives:

- ``encode_state(tree) -> bytes`` / ``decode_state(data) -> tree``: msgpack of plain
  values (None, bool, int, float, str, bytes, lists, string-keyed dicts) and numpy
  arrays (an extension type: dtype, shape, raw bytes). No classes and no code: a
  snapshot read back can only produce data, never run anything (unlike pickle).
- ``StateStore(changelog, max_chunk_bytes=...)``: ``save(key, tree) -> generation``
  writes one snapshot; ``load(key) -> tree | None`` returns the newest complete one.
- ``Changelog``: the log a store writes to and replays (``append`` records, ``replay``
  them in log order). ``MemoryChangelog`` here; ``serving.kafka_io.KafkaChangelog``
  over a compacted Kafka topic (the way Kafka Streams and quix-streams keep state).

Record layout (what makes a crash mid-save harmless): a snapshot of generation ``g``
under ``key`` is written as chunks ``key␟g␟0 .. key␟g␟n-1`` (␟: the unit separator) (each at most
``max_chunk_bytes``), then one head record ``key`` naming ``g``, ``n``, the total length
and its CRC32C, then tombstones (value None) for the previous generation's chunks, so
compaction drops them. A reader takes the newest head whose chunks are all present and
whose CRC matches; a save cut short leaves chunks without a head, which are ignored,
and the previous generation is still whole. Keys are per state owner (e.g. one per
consumer-group partition), so sidecars of one group never write the same key.

Used by ``serve --state-topic`` (``serving.shards``): one key per consumer-group
partition, holding that partition's state (``serving.checkpoint``) and position.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import msgspec
import numpy as np

from executor.crc import checksum

_EXT_NDARRAY = 1
_EXT_BIGINT = 2
_INT_MIN, _UINT_MAX = -(1 << 63), (1 << 64) - 1
MAX_SNAPSHOT_BYTES = 1 << 31
"""A head claiming more than this is refused (bounded memory on restore)."""


class StateDecodeError(ValueError):
    """A snapshot could not be decoded: it is ignored and an older one is used (or the
    sidecar starts empty). Check the changelog topic for writers other than kvwarm."""


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        header = msgspec.msgpack.encode([obj.dtype.str, list(obj.shape)])
        data = np.ascontiguousarray(obj).tobytes()
        return msgspec.msgpack.Ext(_EXT_NDARRAY, len(header).to_bytes(4, "little") + header + data)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot snapshot a {type(obj).__name__}: convert it to plain data first")


def _big_ints(tree: Any) -> Any:
    """Ints msgpack cannot hold (an RNG's 128-bit state) as an extension; the
    containers are walked, arrays are leaves."""
    if isinstance(tree, dict):
        return {k: _big_ints(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_big_ints(v) for v in tree]
    if type(tree) is int and not _INT_MIN <= tree <= _UINT_MAX:
        return msgspec.msgpack.Ext(_EXT_BIGINT, str(tree).encode())
    return tree


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == _EXT_BIGINT:
        if len(data) > 4096:
            raise StateDecodeError("an integer of more than 4096 digits in a snapshot")
        return int(bytes(data))
    if code != _EXT_NDARRAY:
        raise StateDecodeError(f"unknown extension type {code} in a snapshot")
    n = int.from_bytes(data[:4], "little")
    dtype_str, shape = msgspec.msgpack.decode(data[4 : 4 + n])
    dtype = np.dtype(dtype_str)
    if dtype.hasobject:
        raise StateDecodeError("object arrays are not allowed in snapshots")
    array = np.frombuffer(data[4 + n :], dtype=dtype)
    return array.reshape(shape).copy()


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(ext_hook=_ext_hook)


def encode_state(tree: Any) -> bytes:
    """Plain data and numpy arrays -> bytes (tuples come back as lists)."""
    return _ENCODER.encode(_big_ints(tree))


def decode_state(data: bytes) -> Any:
    """Inverse of ``encode_state``; raises ``StateDecodeError`` on anything else."""
    try:
        return _DECODER.decode(data)
    except StateDecodeError:
        raise
    except (msgspec.DecodeError, ValueError, TypeError) as exc:
        raise StateDecodeError(f"malformed snapshot: {exc}") from exc


class Changelog(Protocol):
    """Where snapshots go. ``append`` returns once the records are durable (a Kafka
    changelog: acknowledged by the broker); ``replay`` yields every record still in the
    log, oldest first (compaction may have dropped superseded ones)."""

    def append(self, records: Iterable[tuple[bytes, bytes | None]]) -> None: ...

    def replay(self) -> Iterator[tuple[bytes, bytes | None]]: ...


class MemoryChangelog:
    """A changelog in this process (tests, and a store that needs no durability)."""

    def __init__(self) -> None:
        self.records: list[tuple[bytes, bytes | None]] = []
        self._lock = threading.Lock()

    def append(self, records: Iterable[tuple[bytes, bytes | None]]) -> None:
        with self._lock:
            self.records.extend(records)

    def replay(self) -> Iterator[tuple[bytes, bytes | None]]:
        with self._lock:
            snapshot = list(self.records)
        yield from snapshot


def _parse_head(value: bytes | None) -> dict[str, int] | None:
    """A head record's fields, or None when ``value`` is not a well-formed head."""
    if value is None:
        return None
    try:
        head = msgspec.msgpack.decode(value)
    except msgspec.DecodeError:
        return None
    fields = ("g", "n", "len", "crc")
    if not isinstance(head, dict) or not all(
        type(head.get(f)) is int and head[f] >= 0 for f in fields
    ):
        return None
    return {f: head[f] for f in fields}


_SEP = "\x1f"  # between a key, a generation and a chunk index; never in a key


def _chunk_key(key: str, generation: int, index: int) -> bytes:
    return f"{key}{_SEP}{generation}{_SEP}{index}".encode()


class StateStore:
    """Chunked, generation-tagged snapshots in a ``Changelog``; see the module docstring."""

    def __init__(self, changelog: Changelog, *, max_chunk_bytes: int = 512 << 10) -> None:
        if not 1024 <= max_chunk_bytes <= 8 << 20:
            raise ValueError(f"max_chunk_bytes must be in [1 KiB, 8 MiB], got {max_chunk_bytes}")
        self.changelog = changelog
        self.max_chunk_bytes = max_chunk_bytes
        self._heads: dict[str, dict[str, int]] = {}
        self._loaded = False

    def save(self, key: str, tree: Any) -> int:
        """Write a snapshot of ``tree`` under ``key``; returns its generation."""
        if not key or _SEP in key:
            raise ValueError(f"state key {key!r} must be non-empty and without \\x1f")
        self._ensure_loaded()
        payload = encode_state(tree)
        previous = self._heads.get(key)
        generation = previous["g"] + 1 if previous else 1
        size = self.max_chunk_bytes
        chunks = [payload[i : i + size] for i in range(0, len(payload), size)] or [b""]
        head = {"g": generation, "n": len(chunks), "len": len(payload), "crc": checksum(payload)}
        records: list[tuple[bytes, bytes | None]] = [
            (_chunk_key(key, generation, i), chunk) for i, chunk in enumerate(chunks)
        ]
        self.changelog.append(records)  # every chunk is durable before the head names it
        self.changelog.append([(key.encode(), msgspec.msgpack.encode(head))])
        if previous:
            self.changelog.append(
                [(_chunk_key(key, previous["g"], i), None) for i in range(previous["n"])]
            )
        self._heads[key] = head
        return generation

    def load(self, key: str) -> Any | None:
        """The newest complete snapshot under ``key``, or None when there is none."""
        return self.load_many([key])[key]

    def load_many(self, keys: Iterable[str]) -> dict[str, Any | None]:
        """``load`` for several keys with one pass over the changelog (a sidecar given
        several partitions reads the topic once, not once per partition)."""
        wanted = {key.encode(): key for key in keys}
        heads: dict[str, list[dict[str, int]]] = {key: [] for key in wanted.values()}
        chunks: dict[bytes, bytes] = {}
        sep = _SEP.encode()
        for record_key, value in self.changelog.replay():
            key = wanted.get(record_key)
            if key is not None:
                if value is None:  # the key was deleted
                    heads[key].clear()
                elif (head := _parse_head(value)) is not None:
                    heads[key].append(head)
            elif record_key.split(sep, 1)[0] in wanted:
                if value is None:
                    chunks.pop(record_key, None)
                else:
                    chunks[record_key] = value
        return {key: self._newest(key, heads[key], chunks) for key in heads}

    def _newest(
        self, key: str, heads: list[dict[str, int]], chunks: dict[bytes, bytes]
    ) -> Any | None:
        for head in reversed(heads):  # newest first; an incomplete one falls back
            if head["len"] > MAX_SNAPSHOT_BYTES or head["n"] > MAX_SNAPSHOT_BYTES:
                continue
            parts = [chunks.get(_chunk_key(key, head["g"], i)) for i in range(head["n"])]
            if any(p is None for p in parts):
                continue
            payload = b"".join(p for p in parts if p is not None)
            if len(payload) != head["len"] or checksum(payload) != head["crc"]:
                continue
            try:
                tree = decode_state(payload)
            except StateDecodeError:
                continue
            self._heads[key] = head
            return tree
        return None

    def _ensure_loaded(self) -> None:
        """Learn the newest generation of every key once, so a restarted writer never
        reuses a generation number."""
        if self._loaded:
            return
        for record_key, value in self.changelog.replay():
            if _SEP.encode() in record_key or (head := _parse_head(value)) is None:
                continue
            name = record_key.decode(errors="replace")
            current = self._heads.get(name)
            if current is None or head["g"] > current["g"]:
                self._heads[name] = head
        self._loaded = True
