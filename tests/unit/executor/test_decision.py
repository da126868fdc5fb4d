"""The Decision schema: round trip and validation."""

from __future__ import annotations

import json

import pytest

from executor.decision import Decision, DecisionValidationError


def test_round_trip_through_json() -> None:
    decision = Decision(
        decision_id="lgbm-17",
        ts_ms=1_700_000_000_000,
        block_hash=(1 << 64) - 1,
        action="promote",
        from_tier="nvme",
        to_tier="dram",
        score=0.93,
        policy="lightgbm",
        model_version="3",
        deadline_ms=1_700_000_000_250,
    )
    data = json.loads(json.dumps(decision.to_dict()))
    assert Decision.from_dict(data) == decision
    assert set(data) == {
        "decision_id", "ts_ms", "block_hash", "action", "from_tier", "to_tier",
        "score", "policy", "model_version", "deadline_ms",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("change", "field", "match"),
    [
        ({"action": "prefetch"}, "action", "use one of promote, demote, evict, pin, unpin"),
        ({"to_tier": "ssd"}, "to_tier", "unknown tier 'ssd'"),
        ({"to_tier": "remote"}, "to_tier", "promote needs a faster to_tier"),
        ({"to_tier": None}, "to_tier", "required for promote"),
        ({"block_hash": -3}, "block_hash", ">= 0"),
        ({"block_hash": 1 << 64}, "block_hash", "64 unsigned bits"),
        ({"block_hash": "abc"}, "block_hash", "expected an integer"),
        ({"ts_ms": True}, "ts_ms", "expected an integer"),
        ({"score": float("nan")}, "score", "finite"),
        ({"decision_id": ""}, "decision_id", "non-empty"),
        ({"deadline_ms": -1}, "deadline_ms", ">= 0"),
        ({"colour": "red"}, "colour", "unknown field"),
    ],
)
def test_invalid_fields_are_named(change: dict, field: str, match: str) -> None:
    data = {"decision_id": "d1", "ts_ms": 5, "block_hash": 9, "action": "promote",
            "from_tier": "nvme", "to_tier": "hbm"}  # fmt: skip
    data.update(change)
    with pytest.raises(DecisionValidationError, match=match) as info:
        Decision.from_dict(data)
    assert info.value.field == field


def test_missing_required_field_and_evict_rules() -> None:
    with pytest.raises(DecisionValidationError, match="'block_hash': is missing"):
        Decision.from_dict({"decision_id": "d", "ts_ms": 1, "action": "evict"})
    with pytest.raises(DecisionValidationError, match="must be null for evict"):
        Decision("d", 1, 2, "evict", to_tier="dram")
    assert (
        Decision.from_dict(
            {"decision_id": "d", "ts_ms": 1.0, "block_hash": 2, "action": "pin"}
        ).ts_ms
        == 1
    )
