"""Decoders at the edge: bytes and trace rows in, typed events out.

Primitives:

- ``decode_mooncake(obj, request_id)`` / ``decode_canonical(obj)``: one parsed JSON
  object to ``BlocksAccessed``.
- ``decode_kv_event_batch(payload)``: a vLLM/SGLang ``KVEventBatch`` msgpack payload
  (tagged-map or positional-array encoding) to residency events
  (``kv_events_from_batch`` for a batch already decoded from msgpack).
- ``decode_message(payload)``: sniff JSON vs msgpack (what a Kafka or ZMQ source
  calls per message).
- ``read_trace(path, ...)``: stream a trace file (Mooncake JSONL, canonical JSONL or
  CSV; gzip or plain) in constant memory, yielding valid events and counting every
  reject in a ``RejectLog`` (optionally written to a rejects file).

Every failure raises or records ``EventValidationError`` with a short ``reason`` tag;
a bad row never costs a neighbouring good one.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import msgspec

from features.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlocksAccessed,
    BlockStored,
    EventValidationError,
    ResidencyEvent,
    block_hash_from,
    block_hashes_from,
    normalize_tier,
)

MOONCAKE_BLOCK_SIZE_TOKENS = 512
"""Tokens per KV block in the Mooncake traces."""

DEFAULT_BACKWARDS_TOLERANCE_MS = 1_000
"""How far a timestamp may step back before the row is rejected. Rows within the
tolerance are kept with their timestamp raised to the latest seen, so consumers always
see a non-decreasing clock."""

TRACE_FORMATS = ("auto", "mooncake", "jsonl", "csv")

TIME_UNITS = ("auto", "s", "ms", "us", "ns")
"""Units a trace's timestamps may be in (``--time-unit``). ``auto`` decides once, from
the first row's timestamp: epoch-sized values by magnitude (>= 1e17 ns, >= 1e14 us,
>= 1e11 ms, >= 1e8 s), a fractional value below that is seconds, anything else ms
(Mooncake's traces count ms from the trace start)."""

_MS_PER_UNIT = {"s": 1000.0, "ms": 1.0, "us": 1e-3, "ns": 1e-6}

MAX_TS_JUMP_MS = 30 * 86_400_000
"""A row more than this far ahead of the latest accepted timestamp is rejected alone
(``ts_jump``) without moving the clock, so one absurd timestamp does not make every
good row after it look like it goes back. ``MAX_TS_JUMPS_IN_A_ROW`` such rows in a row
are taken as a real gap: the clock moves on from there."""

MAX_TS_JUMPS_IN_A_ROW = 3


def guess_time_unit(value: Any) -> str:
    """The unit ``auto`` picks for a first timestamp ``value`` (see ``TIME_UNITS``)."""
    number = _number(value)
    if number is None:
        return "ms"
    magnitude = abs(number)
    for bound, unit in ((1e17, "ns"), (1e14, "us"), (1e11, "ms"), (1e8, "s")):
        if magnitude >= bound:
            return unit
    return "s" if not float(number).is_integer() else "ms"


def _number(value: Any) -> int | float | None:
    """A JSON number or a numeric string (as several public traces ship timestamps)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            try:
                return float(text)
            except ValueError:
                return None
    return None


def timestamp_ms(value: Any, unit: str, field: str = "ts_ms") -> int:
    """A timestamp in ``unit`` (number or numeric string) as integer ms; raises
    ``EventValidationError`` for anything else (NaN, infinity, text, negative)."""
    number = _number(value)
    if number is None:
        if value is None:
            raise EventValidationError(field, "is missing", "missing_field")
        raise EventValidationError(field, f"expected a number, got {value!r:.40}", "bad_type")
    ms = number * _MS_PER_UNIT[unit] if unit != "ms" else number
    if not math.isfinite(ms):
        raise EventValidationError(
            field, f"expected a finite number, got {value!r:.40}", "bad_type"
        )
    if ms < 0:
        raise EventValidationError(field, f"must be >= 0, got {value!r:.40}", "negative")
    if ms >= 2**62:
        raise EventValidationError(
            field, f"{value!r:.40} {unit} is out of range", "ts_out_of_range"
        )
    return int(round(ms))


_json_decoder = msgspec.json.Decoder()


class TraceFormatError(ValueError):
    """A trace file cannot be read as a whole (unknown format, unreadable file)."""


@dataclass
class RejectLog:
    """Counts rejects by reason, keeps the first few messages, and optionally appends
    each reject (with its raw input) as a JSON line to ``path``."""

    path: Path | None = None
    counts: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    max_examples: int = 20
    _fh: IO[str] | None = field(default=None, repr=False)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    first_by_reason: dict[str, str] = field(default_factory=dict)
    """The first message of each reason (what ``summary`` quotes)."""

    def summary(self) -> str:
        """One line: how many rows were rejected and the most common reason with an
        example, e.g. ``1,931 rows rejected, most often bad_type (1,931): t.jsonl:1:
        ts_ms: expected a number``; ``""`` when nothing was rejected."""
        if not self.counts:
            return ""
        reason, n = self.counts.most_common(1)[0]
        others = len(self.counts) - 1
        more = f"; {others} other reason{'s' if others > 1 else ''}" if others else ""
        return (
            f"{self.total:,} rows rejected, most often {reason} ({n:,}), e.g. "
            f"{self.first_by_reason.get(reason, '?')}{more}"
        )

    def add(self, where: str, error: EventValidationError, raw: str | bytes) -> None:
        self.counts[error.reason] += 1
        message = f"{where}: {error}"
        self.first_by_reason.setdefault(error.reason, message[:300])
        if len(self.examples) < self.max_examples:
            self.examples.append(message)
        if self.path is not None:
            if self._fh is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fh = open(self.path, "a", encoding="utf-8")
            if isinstance(raw, bytes):
                raw = raw.decode("utf-8", errors="replace")
            record = {"where": where, "reason": error.reason, "error": str(error), "raw": raw}
            self._fh.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _require(obj: dict[str, Any], name: str) -> Any:
    if name not in obj or obj[name] is None:
        raise EventValidationError(name, "is missing", "missing_field")
    return obj[name]


def decode_mooncake(obj: Any, request_id: str) -> BlocksAccessed:
    """One Mooncake trace row: ``{timestamp, input_length, output_length, hash_ids}``."""
    if not isinstance(obj, dict):
        raise EventValidationError(
            "<row>", f"expected a JSON object, got {type(obj).__name__}", "not_object"
        )
    hash_ids = _require(obj, "hash_ids")
    event = BlocksAccessed.validated(
        ts_ms=_require(obj, "timestamp"),
        request_id=str(obj.get("request_id", request_id)),
        block_hashes=hash_ids,
        block_size_tokens=obj.get("block_size_tokens", MOONCAKE_BLOCK_SIZE_TOKENS),
        input_tokens=_require(obj, "input_length"),
        output_tokens=obj.get("output_length"),
        session_id=obj.get("session_id"),
        model=obj.get("model"),
    )
    return event


def decode_canonical(obj: Any, request_id: str | None = None) -> BlocksAccessed:
    """One canonical access event (``BlocksAccessed.to_dict`` form)."""
    if not isinstance(obj, dict):
        raise EventValidationError(
            "<row>", f"expected a JSON object, got {type(obj).__name__}", "not_object"
        )
    rid = obj.get("request_id") or request_id
    if rid is None:
        raise EventValidationError("request_id", "is missing", "missing_field")
    return BlocksAccessed.validated(
        ts_ms=_require(obj, "ts_ms"),
        request_id=rid,
        block_hashes=_require(obj, "block_hashes"),
        block_size_tokens=_require(obj, "block_size_tokens"),
        input_tokens=obj.get("input_tokens"),
        output_tokens=obj.get("output_tokens"),
        session_id=obj.get("session_id"),
        model=obj.get("model"),
    )


def decode_access_object(obj: Any, request_id: str) -> BlocksAccessed:
    """A parsed JSON object in either access form (canonical or Mooncake)."""
    if isinstance(obj, dict) and "hash_ids" in obj and "block_hashes" not in obj:
        return decode_mooncake(obj, request_id)
    return decode_canonical(obj, request_id)


# --- vLLM KVEventBatch (msgpack) -------------------------------------------------------

_VLLM_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
# Positional field order of the array_like encodings, as declared by vLLM.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def _event_fields(raw: Any) -> tuple[str, dict[str, Any]]:
    """Normalise one event of either encoding to (tag, fields)."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        if tag not in _VLLM_TAGS:
            raise EventValidationError("type", f"unknown KV event tag {tag!r}", "unknown_tag")
        return tag, raw
    if isinstance(raw, (list, tuple)) and raw:
        tag = raw[0]
        if tag not in _VLLM_TAGS:
            raise EventValidationError("type", f"unknown KV event tag {tag!r}", "unknown_tag")
        names = (
            _STORED_FIELDS
            if tag == "BlockStored"
            else _REMOVED_FIELDS
            if tag == "BlockRemoved"
            else ()
        )
        values = list(raw[1:])
        if len(values) > len(names):
            raise EventValidationError(
                tag, f"{len(values)} fields, at most {len(names)} expected", "bad_shape"
            )
        return tag, dict(zip(names, values, strict=False))
    raise EventValidationError(
        "events", f"expected a map or array event, got {raw!r:.60}", "bad_shape"
    )


def _residency_event(raw: Any, ts_ms: int, engine_id: str, dp_rank: int | None) -> ResidencyEvent:
    tag, f = _event_fields(raw)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared(ts_ms=ts_ms, engine_id=engine_id, data_parallel_rank=dp_rank)
    hashes = block_hashes_from(f.get("block_hashes"))
    tier = normalize_tier(f.get("medium"))
    if tag == "BlockRemoved":
        return BlockRemoved(
            ts_ms=ts_ms,
            block_hashes=hashes,
            tier=tier,
            engine_id=engine_id,
            data_parallel_rank=dp_rank,
        )
    parent = f.get("parent_block_hash")
    token_ids = f.get("token_ids") or []
    if not isinstance(token_ids, (list, tuple)):
        raise EventValidationError("token_ids", "expected a list", "bad_type")
    block_size = f.get("block_size") or 0
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 0:
        raise EventValidationError(
            "block_size", f"expected a non-negative integer, got {block_size!r}", "bad_type"
        )
    lora_name = f.get("lora_name")
    return BlockStored(
        ts_ms=ts_ms,
        block_hashes=hashes,
        parent_block_hash=None if parent is None else block_hash_from(parent, "parent_block_hash"),
        block_size_tokens=block_size,
        tier=tier,
        num_tokens=len(token_ids),
        engine_id=engine_id,
        data_parallel_rank=dp_rank,
        lora_name=lora_name if isinstance(lora_name, str) else None,
    )


def decode_kv_event_batch(payload: bytes, engine_id: str = "") -> list[ResidencyEvent]:
    """Decode a vLLM/SGLang ``KVEventBatch`` msgpack payload.

    The batch is always an array ``[ts, events, data_parallel_rank?]`` (``array_like``);
    each event is a tagged map ``{"type": "BlockStored", ...}`` (current vLLM) or a
    positional array ``["BlockStored", hashes, parent, ...]`` (older releases). The whole
    batch is rejected if any event in it is malformed: a batch is one engine step.
    """
    try:
        batch = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, ValueError) as exc:
        raise EventValidationError("<payload>", f"not msgpack: {exc}", "not_msgpack") from None
    return kv_events_from_batch(batch, engine_id)


def kv_events_from_batch(batch: Any, engine_id: str = "") -> list[ResidencyEvent]:
    """``decode_kv_event_batch`` for a batch already decoded from msgpack (the ZMQ bridge
    decodes once, validates here, then forwards the raw events one by one)."""
    if isinstance(batch, dict):
        ts, events, dp_rank = batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")
        dp_rank = batch.get("attn_dp_rank", dp_rank)
    elif isinstance(batch, (list, tuple)) and len(batch) >= 2:
        ts, events = batch[0], batch[1]
        dp_rank = batch[2] if len(batch) > 2 else None
    else:
        raise EventValidationError(
            "<batch>", f"expected [ts, events, dp_rank], got {batch!r:.60}", "bad_shape"
        )
    # NaN and infinity pass a plain ``< 0`` check and then break the conversion to ms.
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not 0 <= ts < 1e15:
        raise EventValidationError(
            "ts", f"expected a non-negative number of seconds, got {ts!r}", "bad_type"
        )
    if not isinstance(events, (list, tuple)):
        raise EventValidationError("events", "expected a list", "bad_type")
    if dp_rank is not None and (isinstance(dp_rank, bool) or not isinstance(dp_rank, int)):
        raise EventValidationError(
            "data_parallel_rank", f"expected an integer, got {dp_rank!r}", "bad_type"
        )
    ts_ms = int(round(ts * 1000))
    return [_residency_event(raw, ts_ms, engine_id, dp_rank) for raw in events]


def decode_message(payload: bytes, request_id: str = "", engine_id: str = "") -> list[Any]:
    """Decode one stream message: JSON (canonical or Mooncake access event, or a JSON
    list of them) or a msgpack ``KVEventBatch``. Returns the events it holds."""
    head = payload.lstrip()[:1]
    if head in (b"{", b"["):
        try:
            obj = _json_decoder.decode(payload)
        except (msgspec.DecodeError, ValueError) as exc:
            raise EventValidationError("<payload>", f"broken JSON: {exc}", "bad_json") from None
        if isinstance(obj, list):
            return [decode_access_object(o, f"{request_id}/{i}") for i, o in enumerate(obj)]
        return [decode_access_object(obj, request_id)]
    return list(decode_kv_event_batch(payload, engine_id))


# --- trace files ---------------------------------------------------------------------


def _open_text(path: Path) -> IO[str]:
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def detect_format(path: Path) -> str:
    """Sniff a trace's format from its first non-empty line."""
    name = path.name.lower().removesuffix(".gz")
    if name.endswith(".csv"):
        return "csv"
    with _open_text(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                raise TraceFormatError(
                    f"{path}: first line is not JSON and the name does not end in .csv; "
                    "pass --format mooncake|jsonl|csv"
                ) from None
            if isinstance(obj, dict) and "hash_ids" in obj:
                return "mooncake"
            return "jsonl"
    return "jsonl"


def _csv_rows(fh: IO[str]) -> Iterator[tuple[int, dict[str, Any] | EventValidationError, str]]:
    reader = csv.DictReader(fh)
    if not reader.fieldnames or "block_hashes" not in reader.fieldnames:
        raise TraceFormatError(
            "CSV trace needs a header with at least ts_ms, block_hashes, block_size_tokens"
        )
    for row in reader:
        line_no = reader.line_num
        raw = ",".join(str(v) for v in row.values())
        try:
            obj: dict[str, Any] = {}
            for key, value in row.items():
                if value is None or value == "" or key is None:
                    continue
                if key == "block_hashes":
                    obj[key] = [int(x) for x in value.replace(";", " ").split()]
                elif key in ("block_size_tokens", "input_tokens", "output_tokens"):
                    obj[key] = int(value)
                else:
                    obj[key] = value
            yield line_no, obj, raw
        except ValueError as exc:
            yield line_no, EventValidationError("<row>", f"not a number: {exc}", "bad_type"), raw


def read_trace(
    path: str | os.PathLike[str],
    *,
    fmt: str = "auto",
    rejects: RejectLog | None = None,
    backwards_tolerance_ms: int = DEFAULT_BACKWARDS_TOLERANCE_MS,
    time_unit: str = "auto",
) -> Iterator[BlocksAccessed]:
    """Stream the access events of a trace file in constant memory.

    Rows without a request id get ``"<line number>"``. Rejected rows are recorded in
    ``rejects`` (created if not given; pass one to read the counts afterwards).
    Timestamps (numbers or numeric strings) are read in ``time_unit`` (``TIME_UNITS``)
    and converted to ms. Raises ``TraceFormatError`` at once (before the first row) for
    a file that is missing, unreadable or not a trace.
    """
    path = Path(path)
    check_trace_file(path, fmt)
    if time_unit not in TIME_UNITS:
        raise TraceFormatError(f"unknown time unit {time_unit!r}; valid: {', '.join(TIME_UNITS)}")
    if fmt == "auto":
        fmt = detect_format(path)
    return _read_trace(path, fmt, rejects, backwards_tolerance_ms, time_unit)


def check_trace_file(path: Path, fmt: str = "auto") -> None:
    """Raise ``TraceFormatError`` naming the problem and the fix when ``path`` cannot be
    a trace: missing, a directory, unreadable, or binary (neither gzip nor text)."""
    if fmt not in TRACE_FORMATS:
        raise TraceFormatError(f"unknown trace format {fmt!r}; valid: {', '.join(TRACE_FORMATS)}")
    if not path.exists():
        raise TraceFormatError(f"{path}: no such trace file; check the path")
    if not path.is_file():
        raise TraceFormatError(f"{path}: not a file; pass a trace file (JSONL or CSV, .gz ok)")
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
        if head[:2] == b"\x1f\x8b":
            with gzip.open(path, "rb") as gz:
                head = gz.read(4096)
    except (OSError, EOFError) as exc:
        raise TraceFormatError(
            f"{path}: cannot be read ({getattr(exc, 'strerror', None) or exc}); "
            "pass a readable trace file"
        ) from None
    if b"\x00" in head:
        raise TraceFormatError(
            f"{path}: binary data, not a trace; pass a JSONL or CSV trace (plain or .gz)"
        )


def _read_trace(
    path: Path,
    fmt: str,
    rejects: RejectLog | None,
    backwards_tolerance_ms: int,
    time_unit: str,
) -> Iterator[BlocksAccessed]:
    log = rejects if rejects is not None else RejectLog()
    latest_ts = -1
    num_jumps = 0
    decode = decode_mooncake if fmt == "mooncake" else decode_access_object
    ts_key = "timestamp" if fmt == "mooncake" else "ts_ms"
    unit = None if time_unit == "auto" else time_unit
    with _open_text(path) as fh:
        rows: Iterator[tuple[int, Any, str]]
        if fmt == "csv":
            rows = _csv_rows(fh)
        else:
            rows = _json_rows(fh)
        for line_no, obj, raw in rows:
            where = f"{path.name}:{line_no}"
            try:
                if isinstance(obj, EventValidationError):
                    raise obj
                if isinstance(obj, dict):
                    key = ts_key if ts_key in obj else "timestamp" if "hash_ids" in obj else "ts_ms"
                    if obj.get(key) is not None:
                        if unit is None:
                            unit = guess_time_unit(obj[key])
                        obj[key] = timestamp_ms(obj[key], unit, key)
                event = decode(obj, str(line_no - 1))
                if latest_ts >= 0 and event.ts_ms - latest_ts > MAX_TS_JUMP_MS:
                    num_jumps += 1
                    if num_jumps < MAX_TS_JUMPS_IN_A_ROW:
                        raise EventValidationError(
                            "ts_ms",
                            f"timestamp {event.ts_ms} jumps {(event.ts_ms - latest_ts) / 86_400_000:,.0f} "
                            f"days ahead of the rows before it",
                            "ts_jump",
                        )
                num_jumps = 0
                if event.ts_ms < latest_ts:
                    if latest_ts - event.ts_ms > backwards_tolerance_ms:
                        raise EventValidationError(
                            "ts_ms",
                            f"timestamp {event.ts_ms} goes back {latest_ts - event.ts_ms} ms "
                            f"(tolerance {backwards_tolerance_ms} ms)",
                            "ts_backwards",
                        )
                    event = replace(event, ts_ms=latest_ts)
                latest_ts = event.ts_ms
            except EventValidationError as exc:
                log.add(where, exc, raw)
                continue
            yield event


def _json_rows(fh: IO[str]) -> Iterator[tuple[int, Any, str]]:
    for line_no, line in enumerate(fh, start=1):
        if not line.strip():
            continue
        try:
            yield line_no, _json_decoder.decode(line), line.rstrip("\n")
        except (msgspec.DecodeError, ValueError) as exc:
            yield (
                line_no,
                EventValidationError("<line>", f"broken JSON: {exc}", "bad_json"),
                line.rstrip("\n"),
            )
