"""Hypothesis-driven decoder fuzzing: no input crashes a decoder or costs a valid event.

Each test prints what it tried and what held (counts).
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from features.decoders import (
    RejectLog,
    decode_kv_event_batch,
    decode_message,
    read_trace,
)
from features.events import EventValidationError

pytestmark = pytest.mark.chaos

FUZZ = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
)
_json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


_msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20),
        st.binary(max_size=20),
    ),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


# A hostile line is never a valid access row: no list-valued "hash_ids" key.
_hostile_lines = st.one_of(
    st.text(max_size=200).filter(lambda s: "\n" not in s and "\r" not in s),
    _json_values.filter(lambda v: not isinstance(v, dict)).map(json.dumps),
    st.dictionaries(
        st.sampled_from(["timestamp", "input_length", "hash_ids", "x"]), _scalars, max_size=4
    ).map(json.dumps),
    st.integers(min_value=900, max_value=5000).map(_deep),
    st.integers(min_value=1, max_value=400).map(
        lambda n: '{"timestamp": ' + "9" * n + ', "input_length": 1, "hash_ids": 5}'
    ),
)


@st.composite
def _trace(draw: st.DrawFn) -> tuple[list[str], list[int]]:
    """Lines mixing valid rows (increasing timestamps) and hostile ones."""
    lines: list[str] = []
    valid_ts: list[int] = []
    ts = 0
    for _ in range(draw(st.integers(min_value=1, max_value=30))):
        if draw(st.booleans()):
            ts += draw(st.integers(min_value=0, max_value=10_000))
            hashes = draw(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=8))
            lines.append(json.dumps({"timestamp": ts, "input_length": 512, "hash_ids": hashes}))
            valid_ts.append(ts)
        else:
            lines.append(draw(_hostile_lines))
    return lines, valid_ts


def test_jsonl_traces_keep_every_valid_row_and_count_every_hostile_one():
    tried = Counter()

    @given(_trace())
    def check(case: tuple[list[str], list[int]]) -> None:
        lines, valid_ts = case
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "t.jsonl"
            path.write_text("\n".join(lines) + "\n")
            rejects = RejectLog()
            # ms given: with "auto" the first row decides the unit, even a rejected one
            events = list(read_trace(path, fmt="mooncake", rejects=rejects, time_unit="ms"))
        assert [e.ts_ms for e in events] == valid_ts  # 0 lost valid events
        assert rejects.total == len(lines) - len(valid_ts) - sum(not s.strip() for s in lines)
        tried["traces"] += 1
        tried["lines"] += len(lines)
        tried["valid"] += len(valid_ts)
        tried["rejected"] += rejects.total
        for reason, n in rejects.counts.items():
            tried[f"reject:{reason}"] += n

    settings(FUZZ, max_examples=80)(check)()
    print(f"jsonl fuzz: {dict(tried)}; 0 crashes, 0 lost valid rows")


def _batch(events: list[object], ts: float = 1.0) -> list[object]:
    return [ts, events, 0]


_stored = st.builds(
    lambda hashes, medium: ["BlockStored", hashes, None, [1, 2, 3], 16, None, medium],
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=4),
    st.sampled_from(["GPU", "cpu", "DISK", None]),
)


def test_msgpack_batches_decode_or_raise_a_validation_error():
    tried = Counter()

    @FUZZ
    @given(
        st.one_of(
            _msgpack_values.map(msgspec.msgpack.encode),
            st.binary(max_size=300),
            st.lists(_stored, min_size=1, max_size=5).map(
                lambda e: msgspec.msgpack.encode(_batch(e))
            ),
        ),
        st.data(),
    )
    def check(payload: bytes, data: st.DataObject) -> None:
        if payload and data.draw(st.booleans()):  # flip a few bytes of it
            raw = bytearray(payload)
            for _ in range(data.draw(st.integers(1, 4))):
                raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
            payload = bytes(raw)
        for decode in (decode_kv_event_batch, decode_message):
            try:
                events = decode(payload)
            except EventValidationError as exc:
                tried[f"rejected:{exc.reason}"] += 1
            else:
                tried["decoded"] += 1
                tried["events"] += len(events)
        tried["payloads"] += 1

    check()
    # Deep nesting in both encodings, past the decoder's recursion limit.
    for payload in (b"\x91" * 10_000 + b"\x90", _deep(10_000).encode()):
        with pytest.raises(EventValidationError):
            decode_message(payload)
        tried["deep_payloads"] += 1
    print(f"msgpack fuzz: {dict(tried)}; 0 crashes")
    assert tried["decoded"] > 0 and tried["payloads"] >= 100
