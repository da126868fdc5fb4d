from __future__ import annotations

import pytest

from features.events import (
    SCHEMA_VERSION,
    BlocksAccessed,
    EventValidationError,
    Tier,
    block_hash_from,
    normalize_tier,
)


def test_valid_event_round_trips_through_dict():
    event = BlocksAccessed.validated(
        ts_ms=5,
        request_id="r1",
        block_hashes=[1, 2, 3],
        block_size_tokens=16,
        input_tokens=40,
        session_id="s",
    )
    data = event.to_dict()
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["block_hashes"] == [1, 2, 3]
    assert "output_tokens" not in data
    assert (
        BlocksAccessed.validated(**{k: v for k, v in data.items() if k != "schema_version"})
        == event
    )


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"ts_ms": -1}, "ts_ms", "negative"),
        ({"ts_ms": None}, "ts_ms", "missing_field"),
        ({"ts_ms": "12"}, "ts_ms", "bad_type"),
        ({"ts_ms": True}, "ts_ms", "bad_type"),
        ({"block_size_tokens": 0}, "block_size_tokens", "negative"),
        ({"block_hashes": [1, "x"]}, "block_hashes", "bad_hash"),
        ({"block_hashes": [1, 2.5]}, "block_hashes", "bad_hash"),
        ({"block_hashes": 7}, "block_hashes", "bad_type"),
        ({"block_hashes": [1 << 64]}, "block_hashes", "bad_hash"),
        ({"request_id": ""}, "request_id", "bad_type"),
        ({"input_tokens": -3}, "input_tokens", "negative"),
        ({"session_id": 4}, "session_id", "bad_type"),
    ],
)
def test_validation_names_field_and_problem(overrides, field, reason):
    kwargs = {"ts_ms": 1, "request_id": "r", "block_hashes": [1], "block_size_tokens": 16}
    kwargs.update(overrides)
    with pytest.raises(EventValidationError) as info:
        BlocksAccessed.validated(**kwargs)
    assert info.value.field == field
    assert info.value.reason == reason
    assert repr(field) in str(info.value)


def test_integral_float_timestamp_is_accepted():
    event = BlocksAccessed.validated(
        ts_ms=3.0, request_id="r", block_hashes=[], block_size_tokens=1
    )
    assert event.ts_ms == 3 and isinstance(event.ts_ms, int)


@pytest.mark.parametrize(
    ("medium", "tier"),
    [
        (None, Tier.HBM),
        ("GPU", Tier.HBM),
        ("gpu", Tier.HBM),
        ("CPU", Tier.DRAM),
        ("cpu_pinned", Tier.DRAM),
        ("CPU_PINNED", Tier.DRAM),
        ("CPU_TIER2", Tier.DRAM),
        ("DISK", Tier.NVME),
        ("Fs", Tier.NVME),
        ("OBJ", Tier.REMOTE),
        ("STORAGE", Tier.REMOTE),
        ("external", Tier.REMOTE),
    ],
)
def test_tier_aliases_are_case_insensitive(medium, tier):
    assert normalize_tier(medium) is tier


def test_unknown_tier_lists_known_spellings():
    with pytest.raises(EventValidationError, match="known spellings: .*gpu") as info:
        normalize_tier("tape")
    assert info.value.reason == "unknown_tier"


def test_tier_order_is_fastest_first():
    assert [t.rank for t in (Tier.HBM, Tier.DRAM, Tier.NVME, Tier.REMOTE)] == [0, 1, 2, 3]


def test_bytes_and_signed_hashes_fold_to_unsigned_64_bits():
    # vLLM's int form of a digest: big-endian, low 64 bits (maybe_convert_block_hash).
    assert block_hash_from(b"ignored" + b"\x00" * 7 + b"\x05") == 5
    assert block_hash_from(b"\x01") == 1
    assert block_hash_from(-1) == (1 << 64) - 1
    with pytest.raises(EventValidationError):
        block_hash_from(b"")
