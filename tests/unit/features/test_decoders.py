from __future__ import annotations

import gzip
import json
from pathlib import Path

import msgspec
import pytest

from features.decoders import (
    RejectLog,
    TraceFormatError,
    decode_kv_event_batch,
    decode_message,
    read_trace,
)
from features.events import AllBlocksCleared, BlockRemoved, BlockStored, EventValidationError, Tier


def _write(path: Path, lines: list[str], gz: bool = False) -> Path:
    data = "\n".join(lines) + "\n"
    if gz:
        with gzip.open(path, "wt") as fh:
            fh.write(data)
    else:
        path.write_text(data)
    return path


MOONCAKE_ROWS = [
    {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 3000, "input_length": 1200, "output_length": 9, "hash_ids": [0, 1, 2]},
]


@pytest.mark.parametrize("gz", [False, True])
def test_mooncake_plain_and_gzip(tmp_path, gz):
    path = _write(
        tmp_path / ("t.jsonl.gz" if gz else "t.jsonl"), [json.dumps(r) for r in MOONCAKE_ROWS], gz
    )
    events = list(read_trace(path))
    assert [e.block_hashes for e in events] == [(0, 1), (0, 1, 2)]
    assert [e.request_id for e in events] == ["0", "1"]
    assert events[1].ts_ms == 3000 and events[1].input_tokens == 1200
    assert all(e.block_size_tokens == 512 for e in events)


def test_bad_rows_are_rejected_with_reasons_and_neighbours_kept(tmp_path):
    good = [
        json.dumps({**MOONCAKE_ROWS[0], "timestamp": t}) for t in (10_000, 20_000, 30_000, 40_000)
    ]
    lines = [
        good[0],
        '{"timestamp": 11000, "input_length": 1, "hash_ids": [1,',  # broken JSON
        json.dumps({"timestamp": 12000, "input_length": 1}),  # missing hash_ids
        json.dumps({"timestamp": -5, "input_length": 1, "hash_ids": [1]}),  # negative
        json.dumps({"timestamp": 13000, "input_length": 1, "hash_ids": ["a"]}),  # non-integer hash
        good[1],
        json.dumps({"timestamp": 5000, "input_length": 1, "hash_ids": [1]}),  # goes back 15 s
        json.dumps({"timestamp": 19_500, "input_length": 1, "hash_ids": [9]}),  # back 0.5 s: kept
        "[1, 2, 3]",  # not an object
        good[2],
        "",
        good[3],
    ]
    path = _write(tmp_path / "t.jsonl", lines)
    rejects_file = tmp_path / "rejects.jsonl"
    log = RejectLog(path=rejects_file)
    events = list(read_trace(path, fmt="mooncake", rejects=log))
    log.close()
    assert [e.ts_ms for e in events] == [10_000, 20_000, 20_000, 30_000, 40_000]
    assert dict(log.counts) == {
        "bad_json": 1,
        "missing_field": 1,
        "negative": 1,
        "bad_hash": 1,
        "ts_backwards": 1,
        "not_object": 1,
    }
    written = [json.loads(line) for line in rejects_file.read_text().splitlines()]
    assert len(written) == 6
    assert written[0]["where"] == "t.jsonl:2" and written[0]["raw"].startswith(
        '{"timestamp": 11000'
    )


def test_canonical_jsonl_and_csv_agree(tmp_path):
    rows = [
        {
            "ts_ms": 1,
            "request_id": "a",
            "block_hashes": [5, 6],
            "block_size_tokens": 16,
            "session_id": "s1",
        },
        {
            "ts_ms": 2,
            "request_id": "b",
            "block_hashes": [5, 7, 8],
            "block_size_tokens": 16,
            "output_tokens": 3,
        },
    ]
    jsonl = _write(tmp_path / "c.jsonl", [json.dumps(r) for r in rows])
    csv_path = tmp_path / "c.csv"
    csv_path.write_text(
        "ts_ms,request_id,block_hashes,block_size_tokens,output_tokens,session_id\n"
        "1,a,5 6,16,,s1\n"
        "2,b,5;7;8,16,3,\n"
        "x,c,1,16,,\n"
    )
    log = RejectLog()
    from_csv = list(read_trace(csv_path, rejects=log))
    assert list(read_trace(jsonl)) == from_csv
    assert log.counts == {"bad_type": 1}


def test_unknown_format_and_missing_file_fail_clearly(tmp_path):
    with pytest.raises(TraceFormatError, match="no such trace file"):
        list(read_trace(tmp_path / "nope.jsonl"))
    with pytest.raises(TraceFormatError, match="valid: auto"):
        list(read_trace(_write(tmp_path / "a.jsonl", ["{}"]), fmt="parquet"))
    with pytest.raises(TraceFormatError, match="--format"):
        list(read_trace(_write(tmp_path / "b.txt", ["hello"])))


def test_read_trace_streams_without_reading_everything(tmp_path):
    path = _write(
        tmp_path / "t.jsonl",
        [json.dumps({**MOONCAKE_ROWS[0], "timestamp": i}) for i in range(1000)],
    )
    it = read_trace(path)
    assert next(it).ts_ms == 0  # the first event comes before the file is consumed
    assert sum(1 for _ in it) == 999


# --- vLLM KVEventBatch, built exactly as vLLM declares the structs -------------------


class _Tagged(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class StoredTagged(_Tagged, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class RemovedTagged(_Tagged, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class ClearedTagged(_Tagged, tag="AllBlocksCleared"):
    pass


class _Positional(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class StoredArray(_Positional, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class RemovedArray(_Positional, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class ClearedArray(_Positional, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list
    data_parallel_rank: int | None = None


@pytest.mark.parametrize(
    ("stored", "removed", "cleared"),
    [(StoredTagged, RemovedTagged, ClearedTagged), (StoredArray, RemovedArray, ClearedArray)],
    ids=["tagged-maps", "positional-arrays"],
)
def test_kv_event_batch_both_encodings(stored, removed, cleared):
    payload = msgspec.msgpack.encode(
        Batch(
            ts=12.5,
            events=[
                stored([1, 2], None, list(range(32)), 16, None, "GPU"),
                stored([b"\x00" * 7 + b"\x03"], 2, [], 0, None, "cpu_pinned"),
                removed([1], "DISK"),
                cleared(),
            ],
            data_parallel_rank=3,
        )
    )
    events = decode_kv_event_batch(payload, engine_id="e0")
    assert isinstance(events[0], BlockStored)
    assert (
        events[0].block_hashes == (1, 2)
        and events[0].tier is Tier.HBM
        and events[0].num_tokens == 32
    )
    assert (
        events[0].ts_ms == 12_500
        and events[0].data_parallel_rank == 3
        and events[0].engine_id == "e0"
    )
    assert (
        events[1].block_hashes == (3,)
        and events[1].parent_block_hash == 2
        and events[1].num_tokens == 0
    )
    assert events[1].tier is Tier.DRAM
    assert isinstance(events[2], BlockRemoved) and events[2].tier is Tier.NVME
    assert isinstance(events[3], AllBlocksCleared)
    assert decode_message(payload) == events[:0] + decode_kv_event_batch(payload)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1\xc1 not msgpack", "not_msgpack"),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockExploded"}]]), "unknown_tag"),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved", ["x"], "GPU"]]]), "bad_hash"),
        (msgspec.msgpack.encode([1.0, [["BlockRemoved", [1], "TAPE"]]]), "unknown_tier"),
        (msgspec.msgpack.encode([1.0, "nope"]), "bad_type"),
        (msgspec.msgpack.encode(["soon", []]), "bad_type"),
        (msgspec.msgpack.encode(7), "bad_shape"),
    ],
)
def test_bad_kv_event_batches_are_rejected(payload, reason):
    with pytest.raises(EventValidationError) as info:
        decode_kv_event_batch(payload)
    assert info.value.reason == reason


def test_decode_message_reads_json_access_events():
    canonical = b'{"ts_ms": 1, "request_id": "a", "block_hashes": [1, 2], "block_size_tokens": 16}'
    mooncake = b'{"timestamp": 4, "input_length": 600, "hash_ids": [1, 2]}'
    assert decode_message(canonical)[0].block_hashes == (1, 2)
    assert decode_message(mooncake, request_id="m")[0].request_id == "m"
    assert len(decode_message(b"[" + canonical + b"," + canonical + b"]")) == 2
    with pytest.raises(EventValidationError) as info:
        decode_message(b'{"ts_ms": 1,')
    assert info.value.reason == "bad_json"


EPOCH_S = 1_700_000_000


@pytest.mark.parametrize(
    ("unit", "scale", "as_string"),
    [("s", 1, False), ("s", 1, True), ("ms", 1_000, False), ("us", 10**6, True),
     ("ns", 10**9, False)],
)  # fmt: skip
def test_time_units_by_magnitude_numbers_and_numeric_strings(tmp_path, unit, scale, as_string):
    rows = [
        {"timestamp": (EPOCH_S + i) * scale, "input_length": 10, "hash_ids": [i]} for i in range(3)
    ]
    if as_string:
        for row in rows:
            row["timestamp"] = str(row["timestamp"])
    path = _write(tmp_path / "t.jsonl", [json.dumps(r) for r in rows])
    expected = [(EPOCH_S + i) * 1000 for i in range(3)]
    assert [e.ts_ms for e in read_trace(path)] == expected  # auto
    assert [e.ts_ms for e in read_trace(path, time_unit=unit)] == expected
    if unit != "ms":  # the wrong unit given explicitly is what the user asked for
        assert [e.ts_ms for e in read_trace(path, time_unit="ms")] != expected


def test_fractional_seconds_and_small_ms_traces(tmp_path):
    path = _write(
        tmp_path / "s.jsonl",
        [json.dumps({"timestamp": t, "input_length": 1, "hash_ids": [1]}) for t in (0.5, 1.25)],
    )
    assert [e.ts_ms for e in read_trace(path)] == [500, 1250]
    # Mooncake's own traces: integer ms from the trace start.
    path = _write(tmp_path / "m.jsonl", [json.dumps(r) for r in MOONCAKE_ROWS])
    assert [e.ts_ms for e in read_trace(path)] == [0, 3000]


def test_one_absurd_timestamp_is_rejected_alone(tmp_path):
    stamps = [1000, 2000, 10**15, 3000, 4000]
    path = _write(
        tmp_path / "t.jsonl",
        [
            json.dumps({"timestamp": t, "input_length": 1, "hash_ids": [i]})
            for i, t in enumerate(stamps)
        ],
    )
    log = RejectLog()
    assert [e.ts_ms for e in read_trace(path, rejects=log, time_unit="ms")] == [
        1000,
        2000,
        3000,
        4000,
    ]
    assert dict(log.counts) == {"ts_jump": 1}


def test_reject_summary_names_the_most_common_reason_with_an_example(tmp_path):
    path = _write(
        tmp_path / "t.jsonl",
        ['{"timestamp": "soon", "input_length": 1, "hash_ids": [1]}'] * 3 + ["{broken"],
    )
    log = RejectLog()
    assert list(read_trace(path, rejects=log)) == []
    summary = log.summary()
    assert summary.startswith("4 rows rejected, most often bad_type (3), e.g. t.jsonl:1:")
    assert "'soon'" in summary and "1 other reason" in summary


def test_binary_and_missing_files_fail_before_the_first_row(tmp_path):
    binary = tmp_path / "x.bin"
    binary.write_bytes(bytes(range(256)))
    with pytest.raises(TraceFormatError, match="binary data"):
        read_trace(binary)  # not iterated: the check is eager
    with pytest.raises(TraceFormatError, match="no such trace file"):
        read_trace(tmp_path / "nope.jsonl")
