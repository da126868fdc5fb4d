"""Snapshots in a changelog: round trip with numpy arrays, chunking, a save cut short
falls back to the previous generation, hostile records are data, never code."""

from __future__ import annotations

import numpy as np
import pytest

from serving.state_store import (
    MemoryChangelog,
    StateDecodeError,
    StateStore,
    decode_state,
    encode_state,
)


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "placement": {"tiers": ["hbm", "dram"], "blocks": rng.integers(0, 1 << 62, 5000)},
        "last_access": rng.integers(0, 10**12, 5000).astype(np.int64),
        "scores": rng.random((100, 3)).astype(np.float32),
        "rng": np.random.Generator(np.random.PCG64(seed)).bit_generator.state,
        "origin": "req-7+prefetch@123",
    }


def _equal(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    return a == b


def test_a_snapshot_round_trips_in_chunks() -> None:
    log = MemoryChangelog()
    store = StateStore(log, max_chunk_bytes=4096)
    tree = _tree(1)
    assert store.save("group/events/0", tree) == 1
    num_chunks = sum(1 for k, _ in log.records if k.startswith(b"group/events/0\x1f1\x1f"))
    assert num_chunks == -(-len(encode_state(tree)) // 4096) > 10
    restored = StateStore(log).load("group/events/0")
    assert _equal(restored, tree)
    assert StateStore(log).load("group/events/1") is None


def test_a_save_cut_short_falls_back_to_the_previous_generation() -> None:
    log = MemoryChangelog()
    StateStore(log, max_chunk_bytes=4096).save("p0", _tree(1))
    # A second writer (a restarted sidecar) learns generation 1 and writes 2...
    second = StateStore(log, max_chunk_bytes=4096)
    assert second.save("p0", _tree(2)) == 2
    assert _equal(StateStore(log).load("p0"), _tree(2))
    # ...and old chunks were tombstoned, so compaction can drop them.
    assert any(k.startswith(b"p0\x1f1\x1f") and v is None for k, v in log.records)
    # A third save killed after some chunks (no head): generation 2 is still served.
    partial = StateStore(MemoryChangelog(), max_chunk_bytes=4096)
    partial.save("p0", _tree(3))
    chunks = [
        (k.replace(b"p0\x1f1\x1f", b"p0\x1f3\x1f"), v) for k, v in partial.changelog.records[:3]
    ]
    log.append(chunks)
    assert _equal(StateStore(log).load("p0"), _tree(2))
    # A head whose chunk was corrupted in the log is skipped too.
    corrupt = MemoryChangelog()
    StateStore(corrupt, max_chunk_bytes=4096).save("p0", _tree(4))
    key, value = corrupt.records[0]
    assert value is not None
    corrupt.records[0] = (key, bytes([value[0] ^ 0xFF]) + value[1:])
    assert StateStore(corrupt).load("p0") is None


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # never-used msgpack byte
        b"\xd4\x07\x00",  # unknown extension type
        b"\x92\x01",  # truncated array
    ],
)
def test_malformed_snapshots_are_refused_with_a_reason(data: bytes) -> None:
    with pytest.raises(StateDecodeError):
        decode_state(data)


def test_object_arrays_and_classes_cannot_be_snapshotted_or_restored() -> None:
    with pytest.raises(TypeError, match="cannot snapshot"):
        encode_state({"x": object()})
    import msgspec

    header = msgspec.msgpack.encode(["|O", [1]])
    ext = msgspec.msgpack.Ext(1, len(header).to_bytes(4, "little") + header + b"\x00" * 8)
    with pytest.raises(StateDecodeError, match="object arrays"):
        decode_state(msgspec.msgpack.encode(ext))
