"""Decisions <-> KV hint envelopes: lossless, schema-valid, acks in one vocabulary."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor.decision import Decision
from executor.kvhints import (
    ACK_STATUSES,
    MAX_ACTIONS_PER_ENVELOPE,
    SCHEMA_PATH,
    HintError,
    ack_status_of,
    decision_format,
    decisions_from_envelope,
    decisions_from_record,
    make_ack,
    parse_ack,
    to_envelope,
)

SCHEMA = json.loads(SCHEMA_PATH.read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def validate(obj: Any) -> None:
    VALIDATOR.validate(obj)


def test_schema_is_a_valid_2020_12_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)


EVERY_ACTION = [
    Decision("p1", 10, 2**64 - 1, "promote", "nvme", "hbm", 0.75, "lightgbm", "7", 5_010),
    Decision("p2", 10, 5, "promote", None, "dram", None, "lru", "", None),
    Decision("d1", 11, 6, "demote", "hbm", "dram", -1.5, "lru", "builtin", 5_011),
    Decision("e1", 12, 7, "evict", "nvme", None, 0.0, "lstm", "2", 5_012),
    Decision("e2", 12, 8, "evict", None, None, None, "lstm", "2", None),
    Decision("n1", 13, 9, "pin", "hbm", None, 1.0, "lru", "", 6_000),
    Decision("u1", 14, 9, "unpin", None, None, None, "lru", "", None),
]


def test_every_decision_action_round_trips_through_a_valid_envelope() -> None:
    envelope = json.loads(json.dumps(to_envelope(EVERY_ACTION)))  # through JSON text
    validate(envelope)
    assert [a["action_type"] for a in envelope["actions"]] == [
        "kv.prefetch", "kv.prefetch", "kv.demote", "kv.evict", "kv.evict", "kv.pin", "kv.pin",
    ]  # fmt: skip
    assert decisions_from_envelope(envelope) == EVERY_ACTION


tiers = st.sampled_from(["hbm", "dram", "nvme", "remote"])


@st.composite
def decisions(draw: st.DrawFn) -> Decision:
    action = draw(st.sampled_from(["promote", "demote", "evict", "pin", "unpin"]))
    a, b = sorted(
        draw(st.lists(tiers, min_size=2, max_size=2, unique=True)),
        key=["hbm", "dram", "nvme", "remote"].index,
    )
    from_tier, to_tier = {
        "promote": (draw(st.none() | st.just(b)), a),
        "demote": (draw(st.none() | st.just(a)), b),
        "evict": (draw(st.none() | st.just(a)), None),
    }.get(action, (draw(st.none() | st.just(a)), None))
    return Decision(
        decision_id=draw(st.from_regex(r"[A-Za-z0-9_.:+@#é-]{1,40}", fullmatch=True)),
        ts_ms=draw(st.integers(0, 2**53)),
        block_hash=draw(st.integers(0, 2**64 - 1)),
        action=action,  # type: ignore[arg-type]
        from_tier=from_tier,
        to_tier=to_tier,
        score=draw(st.none() | st.floats(allow_nan=False, allow_infinity=False)),
        policy=draw(st.text(max_size=10)),
        model_version=draw(st.text(max_size=10)),
        deadline_ms=draw(st.none() | st.integers(0, 2**53)),
    )  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(st.lists(decisions(), max_size=20))
def test_any_decisions_round_trip_losslessly(batch: list[Decision]) -> None:
    for _, value in decision_format("kvhints").records(batch):
        validate(json.loads(value))
    records = decision_format("kvhints").records(batch)
    back = [d for _, value in records for d in decisions_from_record(value)]
    assert back == batch


def test_large_batches_split_into_bounded_envelopes_with_stable_ids() -> None:
    batch = [
        Decision(f"id{i}", 1, i, "promote", "dram", "hbm")
        for i in range(MAX_ACTIONS_PER_ENVELOPE + 5)
    ]
    records = decision_format("kvhints").records(batch)
    assert [len(json.loads(v)["actions"]) for _, v in records] == [MAX_ACTIONS_PER_ENVELOPE, 5]
    assert records == decision_format("kvhints").records(batch)  # same ids on a resend
    assert records[0][0] != records[1][0]


def test_native_records_are_decision_json_keyed_by_block() -> None:
    (key, value), *_ = decision_format("native").records(EVERY_ACTION)
    assert key == str(2**64 - 1).encode()
    assert Decision.from_dict(json.loads(value)) == EVERY_ACTION[0]


def test_unknown_format_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: native, kvhints"):
        decision_format("protobuf")


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda e: e.update(protocol_version="9"), "protocol_version"),
        (lambda e: e.pop("message_id"), "message_id"),
        (lambda e: e["actions"][0].update(action_type="kv.retain"), "no kvwarm decision"),
        (lambda e: e["actions"][0]["payload"].update(block_hashes=[1, 2]), "exactly one"),
        (lambda e: e["actions"][0]["payload"].update(to_tier="l9"), "unknown tier"),
        (lambda e: e["actions"][0].update(action_version=2), "action_version"),
    ],
)
def test_malformed_envelopes_fail_naming_the_field(mutate: Any, match: str) -> None:
    envelope = to_envelope(EVERY_ACTION[:1])
    mutate(envelope)
    with pytest.raises(HintError, match=match):
        decisions_from_envelope(envelope)


def test_retain_and_admit_veto_are_in_the_schema() -> None:
    validate(
        {
            "protocol_version": "0.1",
            "message_id": "m",
            "actions": [
                {"action_id": "a", "action_type": "kv.retain", "action_version": 1,
                 "payload": {"session_id": "s1", "to_tier": "dram", "ttl_ms": 60_000}},
                {"action_id": "b", "action_type": "kv.admit_veto", "action_version": 1,
                 "payload": {"block_hashes": [3], "to_tier": "nvme", "confidence": 0.9}},
            ],
        }
    )  # fmt: skip
    with pytest.raises(jsonschema.ValidationError):
        validate({"protocol_version": "0.1", "message_id": "m", "actions": [
            {"action_id": "a", "action_type": "kv.retain", "action_version": 1,
             "payload": {"ttl_ms": 5}}]})  # fmt: skip


def test_acks_round_trip_and_refuse_unknown_statuses() -> None:
    ack = make_ack("m1", [("a", "accepted", ""), ("b", "missing", "not cached")])
    validate(ack)
    assert parse_ack(json.loads(json.dumps(ack))) == [("a", "accepted"), ("b", "missing")]
    with pytest.raises(HintError, match="use one of"):
        parse_ack({"message_id": "m", "results": [{"action_id": "a", "status": "ok"}]})


@pytest.mark.parametrize(
    ("status", "reason", "ack"),
    [
        ("applied", "", "accepted"),
        ("skipped", "duplicate decision id", "accepted"),
        ("skipped", "not cached", "missing"),
        ("skipped", "no room in hbm", "rejected"),
        ("failed", "write to dram failed: disk full", "rejected"),
        ("clipped", "", "clipped"),
        ("applied", "clipped: warmed into L1", "clipped"),
        ("duplicate", "", "accepted"),
        ("missing", "", "missing"),
        ("refused_full", "no room", "rejected"),
        ("expired", "deadline passed", "rejected"),
    ],
)
def test_executor_outcomes_map_onto_ack_statuses(status: str, reason: str, ack: str) -> None:
    assert ack_status_of(status, reason) == ack
    assert ack in ACK_STATUSES
