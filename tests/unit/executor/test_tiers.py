"""The Tier contract, run over every tier kind, plus what only disk tiers do:
hostile ids, corruption, quarantine, links, failed writes."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from executor.bandwidth import Pacer
from executor.block_ids import InvalidBlockIdError, block_key, key_to_block_id
from executor.tier import BlockNotFoundError, CorruptBlockError, Tier, TierFullError
from executor.tiers import UnknownTierKindError, make_tier
from executor.tiers.directory import HEADER_BYTES, DirectoryTier, DirectoryTierParams

TierFactory = Callable[[str, int], Tier]
Payload = Callable[[int | str, int], bytes]

HOSTILE_IDS = [
    "../x",
    "..",
    "/etc/passwd",
    "a/b",
    "a\\b",
    "x\x00y",
    "x" * 129,
    "",
    ".hidden",
    "-rf",
    "tab\tname",
    "é",
    -1,
    1 << 64,
    True,
    3.5,
    None,
    b"bytes",
]


def test_contract_write_read_contains_discard(make_tier: TierFactory, payload: Payload) -> None:
    tier = make_tier("dram", 10_000)
    assert tier.used_bytes == 0 and tier.capacity_bytes == 10_000
    tier.write(42, payload(42, 1000))
    tier.write("abc-1.x", payload("s", 10))
    assert tier.contains(42) and tier.contains("abc-1.x") and not tier.contains(43)
    assert bytes(tier.read(42)) == payload(42, 1000)
    assert tier.used_bytes == 1010
    tier.write(42, payload(42, 500))  # overwrite replaces, capacity counts the new size
    assert tier.used_bytes == 510 and bytes(tier.read(42)) == payload(42, 500)
    assert tier.discard(42) and not tier.discard(42)
    assert not tier.contains(42) and tier.used_bytes == 10
    with pytest.raises(BlockNotFoundError, match="not in tier 'dram'"):
        tier.read(42)


def test_contract_capacity_is_never_exceeded(make_tier: TierFactory, payload: Payload) -> None:
    tier = make_tier("dram", 4096)
    tier.write(1, payload(1, 3000))
    with pytest.raises(TierFullError, match="make room first"):
        tier.write(2, payload(2, 2000))
    assert not tier.contains(2) and tier.used_bytes == 3000
    # Many concurrent writers: the reservations keep the sum under capacity.
    errors: list[int] = []

    def writer(i: int) -> None:
        try:
            tier.write(100 + i, payload(i, 500))
        except TierFullError:
            errors.append(i)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tier.used_bytes <= tier.capacity_bytes
    assert 8 - len(errors) == (4096 - 3000) // 500


def test_contract_hostile_ids_are_refused_before_touching_storage(make_tier: TierFactory) -> None:
    tier = make_tier("nvme", 10_000)
    for bad in HOSTILE_IDS:
        with pytest.raises(InvalidBlockIdError, match="invalid block id"):
            tier.write(bad, b"data")  # type: ignore[arg-type]
        with pytest.raises(InvalidBlockIdError):
            tier.contains(bad)  # type: ignore[arg-type]
    assert tier.used_bytes == 0 and tier.block_keys() == []


def test_block_keys_round_trip_and_errors_say_what_is_allowed() -> None:
    assert block_key(0) == "0000000000000000"
    assert key_to_block_id(block_key((1 << 64) - 1)) == (1 << 64) - 1
    assert key_to_block_id(block_key("sess_1.blk")) == "sess_1.blk"
    with pytest.raises(InvalidBlockIdError) as info:
        block_key("../x")
    assert "path separator" in str(info.value) and "[0-9A-Za-z_.-]" in str(info.value)
    with pytest.raises(InvalidBlockIdError, match="contains '..'"):
        block_key("..")
    with pytest.raises(InvalidBlockIdError, match="NUL"):
        block_key("a\x00")
    with pytest.raises(InvalidBlockIdError, match="longer than 128"):
        block_key("a" * 500)


def _disk(tmp_path: Path, **kwargs: object) -> DirectoryTier:
    params = DirectoryTierParams(
        capacity_bytes=1 << 20, root=tmp_path / "nvme", fsync=False, **kwargs
    )  # type: ignore[arg-type]
    return DirectoryTier("nvme", params)


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_corrupt_block_is_detected_on_read_and_quarantined(
    tmp_path: Path, payload: Payload
) -> None:
    tier = _disk(tmp_path)
    tier.write(7, payload(7, 5000))
    _flip_byte(tier.root / block_key(7), HEADER_BYTES + 1234)
    with pytest.raises(CorruptBlockError, match="crc32c mismatch"):
        tier.read(7)
    assert not tier.contains(7) and tier.used_bytes == 0
    assert tier.quarantined == [block_key(7)]
    assert [p.name.split(".")[0] for p in (tier.root / ".quarantine").iterdir()] == [block_key(7)]
    assert not (tier.root / block_key(7)).exists()


def test_recovery_quarantines_corrupt_truncated_and_foreign_entries(
    tmp_path: Path, payload: Payload
) -> None:
    tier = _disk(tmp_path)
    for block in range(5):
        tier.write(block, payload(block, 2000))
    _flip_byte(tier.root / block_key(1), HEADER_BYTES + 10)  # bit rot
    with open(tier.root / block_key(2), "r+b") as f:  # torn write
        f.truncate(HEADER_BYTES + 100)
    (tier.root / "not a key!").write_bytes(b"junk")
    (tier.root / ".tmp" / f"{block_key(9)}.abc").write_bytes(b"half")
    outside = tmp_path / "secret"
    outside.write_bytes(b"do not serve")
    os.symlink(outside, tier.root / "linked_block")
    reopened = _disk(tmp_path)
    report = reopened.recover(verify=True)  # opening checked names and sizes; this reads all
    assert report.num_temp_files_removed == 1
    assert sorted(reopened.quarantined) == sorted(report.quarantined)
    assert sorted(report.quarantined) == sorted(
        [block_key(1), block_key(2), "not a key!", "linked_block"]
    )
    assert sorted(reopened.block_keys()) == [block_key(b) for b in (0, 3, 4)]
    assert reopened.used_bytes == 3 * 2000
    assert outside.read_bytes() == b"do not serve"
    assert list((tier.root / ".tmp").iterdir()) == []


def test_a_link_planted_at_a_block_path_is_not_followed(tmp_path: Path, payload: Payload) -> None:
    tier = _disk(tmp_path)
    tier.write(5, payload(5, 100))
    target = tier.root / block_key(5)
    target.unlink()
    outside = tmp_path / "outside"
    outside.write_bytes(b"x" * 124)
    os.symlink(outside, target)
    with pytest.raises(CorruptBlockError, match="not a regular file"):
        tier.read(5)
    assert outside.read_bytes() == b"x" * 124


def test_a_link_in_place_of_the_temp_directory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", root / ".tmp")
    with pytest.raises(NotADirectoryError, match="not a link"):
        _disk(tmp_path)


def test_failed_write_leaves_no_partial_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, payload: Payload
) -> None:
    tier = _disk(tmp_path)
    tier.write(1, payload(1, 100))

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space"):
        tier.write(2, payload(2, 100))
    monkeypatch.undo()
    assert not tier.contains(2) and tier.used_bytes == 100
    assert list((tier.root / ".tmp").iterdir()) == []
    assert sorted(p.name for p in tier.root.iterdir()) == sorted(
        [".tmp", ".quarantine", block_key(1)]
    )


def test_pacer_books_a_fifo_link() -> None:
    pacer = Pacer(bytes_per_s=1e6)
    first = pacer.slot_end(500_000)
    second = pacer.slot_end(250_000)
    assert second - first == pytest.approx(0.25)


def test_make_tier_by_kind(tmp_path: Path) -> None:
    tier = make_tier("directory", "nvme", {"root": str(tmp_path / "d"), "capacity_bytes": 100})
    assert isinstance(tier, DirectoryTier) and tier.capacity_bytes == 100
    with pytest.raises(UnknownTierKindError, match="use one of"):
        make_tier("tape", "nvme", {})
    with pytest.raises(ValueError, match="unknown tier 'l3'"):
        make_tier("memory", "l3", {"capacity_bytes": 1})
