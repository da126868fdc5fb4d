"""Every input is bounded: depth, size, timestamp range, broken gzip (issue 18)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import msgspec
import pytest

from features import decoders
from features.decoders import RejectLog, decode_kv_event_batch, decode_message, read_trace
from features.events import EventValidationError


def _row(ts: object = 1_000, **extra: object) -> dict[str, object]:
    return {"timestamp": ts, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2], **extra}


def _write(path: Path, lines: list[str], *, gz: bool = False) -> Path:
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _read(path: Path) -> tuple[list[int], RejectLog]:
    rejects = RejectLog(path=path.with_suffix(".rejects"))
    ts = [e.ts_ms for e in read_trace(path, fmt="mooncake", rejects=rejects)]
    rejects.close()
    return ts, rejects


def test_a_line_nested_a_thousand_levels_deep_is_a_counted_reject(tmp_path):
    deep = "[" * 1000 + "]" * 1000
    assert len(deep) == 2000
    path = _write(tmp_path / "t.jsonl", [json.dumps(_row(1)), deep, json.dumps(_row(2))])
    ts, rejects = _read(path)
    assert ts == [1, 2]
    assert rejects.counts == {"too_deep": 1}


@pytest.mark.parametrize("payload", [b"[" * 5000 + b"]" * 5000, b"\x91" * 5000 + b"\x90"])
def test_a_deep_message_is_too_deep_for_json_and_msgpack(payload):
    with pytest.raises(EventValidationError) as info:
        decode_message(payload)
    assert info.value.reason == "too_deep"


def test_a_deep_kv_event_batch_is_too_deep():
    with pytest.raises(EventValidationError) as info:
        decode_kv_event_batch(b"\x91" * 5000 + b"\x90")
    assert info.value.reason == "too_deep"


@pytest.mark.parametrize(
    "ts",
    [10**400, 2**63 - 1, 2**64, -(10**30), 1e300],
    ids=["400_digits", "int64_max", "2^64", "huge_negative", "float_1e300"],
)
def test_absurd_timestamps_are_rejected_at_decode_time(ts):
    with pytest.raises(EventValidationError) as info:
        decoders.decode_mooncake(_row(ts), "r")
    assert info.value.reason == "ts_out_of_range" and "timestamp" in str(info.value)
    canonical = {"ts_ms": ts, "request_id": "r", "block_hashes": [1], "block_size_tokens": 16}
    with pytest.raises(EventValidationError):
        decoders.decode_canonical(canonical)


def test_a_400_digit_timestamp_line_is_a_reject_and_its_neighbours_survive(tmp_path):
    lines = [json.dumps(_row(5)), '{"timestamp": ' + "9" * 400 + ', "input_length": 1, '
             '"hash_ids": [1]}', json.dumps(_row(6))]  # fmt: skip
    ts, rejects = _read(_write(tmp_path / "t.jsonl", lines))
    assert ts == [5, 6] and rejects.counts == {"ts_out_of_range": 1}


def test_token_counts_and_request_sizes_are_bounded():
    with pytest.raises(EventValidationError) as info:
        decoders.decode_mooncake(_row(input_length=2**70), "r")
    assert info.value.reason == "out_of_range"
    row = _row(hash_ids=list(range(decoders.MAX_BLOCKS_PER_REQUEST + 1)))
    with pytest.raises(EventValidationError) as info:
        decoders.decode_mooncake(row, "r")
    assert info.value.reason == "too_large"


def test_a_too_long_line_is_rejected_with_a_bounded_prefix_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(decoders, "MAX_MESSAGE_BYTES", 10_000)
    long_line = json.dumps(_row(2, pad="x" * 50_000))
    path = _write(tmp_path / "t.jsonl", [json.dumps(_row(1)), long_line, json.dumps(_row(3))])
    ts, rejects = _read(path)
    assert ts == [1, 3] and rejects.counts == {"too_large": 1}
    record = json.loads(path.with_suffix(".rejects").read_text().splitlines()[0])
    assert len(record["raw"]) <= decoders.MAX_REJECT_RAW_CHARS
    assert record["raw_truncated_from"] >= decoders.MAX_REJECT_RAW_CHARS


def test_a_large_message_is_too_large(monkeypatch):
    monkeypatch.setattr(decoders, "MAX_MESSAGE_BYTES", 100)
    with pytest.raises(EventValidationError) as info:
        decode_message(b"{" + b" " * 200 + b"}")
    assert info.value.reason == "too_large"
    with pytest.raises(EventValidationError) as info:
        decode_kv_event_batch(msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]] * 50]))
    assert info.value.reason == "too_large"


def test_a_truncated_gzip_trace_keeps_the_rows_before_and_counts_one_reject(tmp_path):
    lines = [json.dumps(_row(i)) for i in range(2000)]
    whole = gzip.compress(("\n".join(lines) + "\n").encode())
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(whole[: len(whole) * 2 // 3])
    ts, rejects = _read(path)
    assert 0 < len(ts) < 2000 and ts == list(range(len(ts)))
    assert rejects.counts == {"corrupt_file": 1}
    assert "truncated or corrupt" in rejects.examples[0]


def test_a_corrupt_gzip_body_is_a_counted_reject(tmp_path):
    lines = [json.dumps(_row(i)) for i in range(2000)]
    data = bytearray(gzip.compress(("\n".join(lines) + "\n").encode()))
    middle = len(data) // 2
    data[middle : middle + 64] = b"\x00" * 64
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(bytes(data))
    ts, rejects = _read(path)
    assert len(ts) < 2000 and rejects.counts["corrupt_file"] == 1


def test_a_gzip_broken_before_the_first_line_names_the_file(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"timestamp": 1}\n' * 10)[:12])
    with pytest.raises(decoders.TraceFormatError, match="gzip"):
        list(read_trace(path))


def test_an_oversized_csv_field_is_a_reject_not_a_crash(tmp_path):
    path = tmp_path / "t.csv"
    big = "1 " * 100_000
    path.write_text("ts_ms,block_hashes,block_size_tokens\n1,1 2,16\n2," + big + ",16\n3,3 4,16\n")
    rejects = RejectLog()
    ts = [e.ts_ms for e in read_trace(path, rejects=rejects)]
    assert ts == [1, 3] and rejects.counts == {"bad_csv": 1}
