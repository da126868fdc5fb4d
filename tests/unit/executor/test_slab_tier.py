"""What only the slab tier does (the Tier contract runs over it in test_tiers.py):
slots reused, restarts, torn slots, a key found twice, corruption,
large blocks read in parts, and the limits on block sizes."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from executor import Executor, ExecutorParams
from executor.block_ids import block_key
from executor.tier import CorruptBlockError, TierError
from executor.tiers import slab as slab_module
from executor.tiers.directory import DirectoryTier, DirectoryTierParams
from executor.tiers.slab import SLOT_HEADER_BYTES, SlabTier, SlabTierParams, slot_bytes_for

Payload = Callable[[int | str, int], bytes]


def _tier(root: Path, **params: object) -> SlabTier:
    settings: dict[str, object] = {"capacity_bytes": 1 << 26, "root": root, "grow_slots": 4}
    return SlabTier("nvme", SlabTierParams(**{**settings, **params}))  # type: ignore[arg-type]


def _slab_file(root: Path, size: int) -> Path:
    return root / f"slab-{slot_bytes_for(size)}.dat"


def test_blocks_share_one_file_per_size_and_slots_are_reused(
    tmp_path: Path, payload: Payload
) -> None:
    tier = _tier(tmp_path)
    for block in range(6):
        tier.write(block, payload(block, 5000))
    tier.write("other", payload("other", 70_000))
    assert sorted(p.name for p in tmp_path.glob("slab-*.dat")) == sorted(
        [_slab_file(tmp_path, 5000).name, _slab_file(tmp_path, 70_000).name]
    )
    size = _slab_file(tmp_path, 5000).stat().st_size
    assert size == 8 * slot_bytes_for(5000)  # two growths of grow_slots=4
    for block in range(6):
        assert tier.discard(block)
    for block in range(10, 16):
        tier.write(block, payload(block, 5000))
    assert _slab_file(tmp_path, 5000).stat().st_size == size  # freed slots taken again
    assert [bytes(tier.read(b)) for b in range(10, 16)] == [payload(b, 5000) for b in range(10, 16)]
    tier.close()


def test_blocks_survive_a_restart_and_discards_stay_discarded(
    tmp_path: Path, payload: Payload
) -> None:
    tier = _tier(tmp_path)
    for block in range(5):
        tier.write(block, payload(block, 3000 + block))
    tier.discard(1)
    tier.write(2, payload("new", 3002))  # replaced: the old slot is freed
    tier.close()
    again = _tier(tmp_path)
    report = again.recover(verify=True)
    assert report.num_blocks == 4 and report.quarantined == []
    assert sorted(again.block_keys()) == sorted(again._key(b) for b in (0, 2, 3, 4))
    assert bytes(again.read(2)) == payload("new", 3002)
    assert again.used_bytes == 3000 + 3002 + 3003 + 3004
    again.close()


def test_torn_slots_are_freed_at_recovery(tmp_path: Path, payload: Payload) -> None:
    """A crash before a group's sync: a slot written whole comes back (as a renamed
    file may: the executor's recovery finishes its move); one whose header was torn is
    freed; one whose header landed without its payload is quarantined."""
    tier = _tier(tmp_path)
    tier.write(1, payload(1, 4000))
    staged = tier.stage_write(2, payload(2, 4000))  # never committed
    tier.write(3, payload(3, 4000))
    tier.write(4, payload(4, 4000))
    slot = slot_bytes_for(4000)
    index3, index4 = (tier._where[tier._key(b)][1] for b in (3, 4))
    tier.close()
    with open(_slab_file(tmp_path, 4000), "r+b") as f:
        f.seek(index3 * slot + 20)  # block 3's header torn
        f.write(b"\xff\xff")
        f.seek(index4 * slot + SLOT_HEADER_BYTES)  # block 4's payload never landed
        f.write(bytes(4000))
    again = _tier(tmp_path)
    report = again.recover(verify=True)
    assert again.contains(2) and bytes(again.read(2)) == payload(2, 4000)
    assert not again.contains(3) and not again.contains(4)
    assert report.num_temp_files_removed == 1 and report.quarantined == [again._key(4)]
    assert staged.key == again._key(2)
    assert bytes(again.read(1)) == payload(1, 4000)
    again.write(5, payload(5, 4000))  # the freed slots are reused, the file does not grow
    again.write(6, payload(6, 4000))
    assert _slab_file(tmp_path, 4000).stat().st_size == 4 * slot
    again.close()


def test_executor_recovery_keeps_the_source_of_a_move_whose_write_was_torn(
    tmp_path: Path, payload: Payload
) -> None:
    """Without verify_on_recovery, recovery reads an unfinished move's destination
    through its checksum before it drops the source: a torn write is quarantined and
    the move rolled back."""

    def open_executor() -> Executor:
        tiers = [
            _tier(tmp_path / "nvme"),
            DirectoryTier(
                "remote", DirectoryTierParams(capacity_bytes=1 << 20, root=tmp_path / "r")
            ),
        ]
        params = ExecutorParams(state_dir=tmp_path / "state", verify_on_recovery=False)
        return Executor(tiers, params)

    ex = open_executor()
    for block in (1, 2):
        ex.write(block, payload(block, 3000), "remote")
    nvme = ex.tier("nvme")
    assert isinstance(nvme, SlabTier)
    for block in (1, 2):  # a crash after the writes, before the group's sync
        ex.journal.begin_move(f"m{block}", block_key(block), "remote", "nvme")
        nvme.write(block, payload(block, 3000))
    slab = nvme._slabs[slot_bytes_for(3000)]
    index = nvme._where[block_key(2)][1]
    os.pwrite(slab.fd, bytes(3000), index * slab.slot_bytes + SLOT_HEADER_BYTES)
    ex.journal.sync()
    ex.close()
    again = open_executor()
    recovery = again.last_recovery
    assert recovery.moves_finished == ["m1"] and recovery.moves_rolled_back == ["m2"]
    assert (again.locate(1), again.locate(2)) == ("nvme", "remote")
    assert bytes(again.read(2) or b"") == payload(2, 3000)
    assert again.tier("nvme").quarantined == [block_key(2)]
    again.close()


def test_a_key_found_twice_keeps_its_newest_copy(tmp_path: Path, payload: Payload) -> None:
    """A crash between committing a replacement and freeing the old slot leaves two
    COMMITTED copies: the higher sequence number wins, the other slot is freed."""
    tier = _tier(tmp_path)
    tier.write(7, payload("old", 2000))
    old_slab, old_index = tier._slabs[slot_bytes_for(2000)], tier._where[tier._key(7)][1]
    old_header = os.pread(old_slab.fd, SLOT_HEADER_BYTES, old_index * old_slab.slot_bytes)
    tier.write(7, payload("new", 2000))
    os.pwrite(old_slab.fd, old_header, old_index * old_slab.slot_bytes)  # the free never landed
    tier.close()
    again = _tier(tmp_path)
    again.recover(verify=True)
    assert bytes(again.read(7)) == payload("new", 2000) and again.used_bytes == 2000
    again.close()
    third = _tier(tmp_path)
    report = third.recover(verify=True)
    assert (report.num_blocks, report.num_temp_files_removed) == (1, 0)  # the loser was zeroed
    assert bytes(third.read(7)) == payload("new", 2000)
    third.close()


def test_a_corrupt_payload_is_quarantined_on_read(tmp_path: Path, payload: Payload) -> None:
    tier = _tier(tmp_path)
    tier.write(1, payload(1, 6000))
    tier.write(2, payload(2, 6000))
    slab = tier._slabs[slot_bytes_for(6000)]
    index = tier._where[tier._key(1)][1]
    os.pwrite(slab.fd, b"\x00" * 8, index * slab.slot_bytes + SLOT_HEADER_BYTES + 100)
    with pytest.raises(CorruptBlockError, match="crc32c mismatch"):
        tier.read(1)
    assert not tier.contains(1) and tier.quarantined == [tier._key(1)]
    assert tier.used_bytes == 6000 and bytes(tier.read(2)) == payload(2, 6000)
    kept = list((tmp_path / ".quarantine").iterdir())
    assert len(kept) == 1 and kept[0].stat().st_size == slab.slot_bytes
    tier.close()
    again = _tier(tmp_path)  # the slot was freed: nothing comes back
    assert again.recover(verify=True).num_blocks == 1
    again.close()


def test_corrupt_payload_found_at_recovery_is_quarantined(tmp_path: Path, payload: Payload) -> None:
    tier = _tier(tmp_path)
    tier.write(1, payload(1, 6000))
    index = tier._where[tier._key(1)][1]
    tier.close()
    with open(_slab_file(tmp_path, 6000), "r+b") as f:
        f.seek(index * slot_bytes_for(6000) + SLOT_HEADER_BYTES + 10)
        f.write(b"garbage")
    again = _tier(tmp_path)
    report = again.recover(verify=True)
    assert report.quarantined == [again._key(1)] and not again.contains(1)
    again.close()


def test_large_blocks_are_read_in_parts(tmp_path: Path, payload: Payload) -> None:
    tier = _tier(tmp_path, read_parts=4, min_part_bytes=1 << 20)
    data = payload("big", (9 << 20) + 123)
    tier.write("big", data)
    assert bytes(tier.read("big")) == data
    buffered = _tier(tmp_path / "b", read_parts=4, min_part_bytes=1 << 20, direct_reads=False)
    buffered.write("big", data)
    assert bytes(buffered.read("big")) == data
    tier.close()
    buffered.close()


def test_too_many_block_sizes_are_refused_with_a_reason(tmp_path: Path, payload: Payload) -> None:
    tier = _tier(tmp_path, max_slot_sizes=2)
    tier.write(1, payload(1, 1000))
    tier.write(2, payload(2, 5000))
    with pytest.raises(TierError, match="raise max_slot_sizes"):
        tier.write(3, payload(3, 9000))
    assert not tier.contains(3) and tier.free_bytes == tier.capacity_bytes - 6000
    tier.close()


def test_foreign_files_and_links_are_left_alone(tmp_path: Path, payload: Payload) -> None:
    tier = _tier(tmp_path)
    tier.write(1, payload(1, 1000))
    tier.close()
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "slab-8192.dat").symlink_to(tmp_path / "notes.txt")
    again = _tier(tmp_path)
    assert again.recover(verify=True).num_blocks == 1 and bytes(again.read(1)) == payload(1, 1000)
    assert (tmp_path / "notes.txt").read_text() == "hello"
    again.close()


def test_a_failed_sync_leaves_nothing_visible(
    tmp_path: Path, payload: Payload, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = _tier(tmp_path)
    tier.write(1, payload(1, 1000))
    staged = [tier.stage_write(b, payload(b, 1000)) for b in (2, 3)]

    def failing(fd: int) -> None:
        raise OSError(5, "injected EIO")

    monkeypatch.setattr(slab_module.os, "fdatasync", failing)
    errors = tier.commit_staged(staged)
    monkeypatch.undo()
    assert [str(e) for e in errors] == ["[Errno 5] injected EIO"] * 2
    assert not tier.contains(2) and not tier.contains(3) and tier.used_bytes == 1000
    tier.close()
    again = _tier(tmp_path)
    assert again.recover(verify=True).num_blocks == 1
    again.close()


def test_moves_out_of_host_memory_are_written_back_and_synced_with_the_journal(
    tmp_path: Path, payload: Payload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A demote from DRAM (volatile) into the slab tier is written back: visible and
    journalled at once, one file sync at ``sync()``; a move from a durable tier into it
    is group-committed (synced before its source is dropped)."""
    from executor import Decision
    from executor.tiers.memory import MemoryTier, MemoryTierParams

    tiers = [
        MemoryTier("dram", MemoryTierParams(capacity_bytes=1 << 20)),
        _tier(tmp_path / "nvme"),
        DirectoryTier("remote", DirectoryTierParams(capacity_bytes=1 << 20, root=tmp_path / "r")),
    ]
    ex = Executor(tiers, ExecutorParams(state_dir=tmp_path / "state"))
    ex.sync_each_apply = False  # as serve's sink runs it: sync() at each flush
    syncs: list[int] = []
    real = os.fdatasync
    monkeypatch.setattr(slab_module.os, "fdatasync", lambda fd: (syncs.append(fd), real(fd))[1])
    for block in range(4):
        ex.write(block, payload(block, 2000), "dram")
    ex.write(9, payload(9, 2000), "remote")
    out = ex.apply([Decision(f"w{b}", 0, b, "demote", "dram", "nvme") for b in range(4)])
    assert [o.status for o in out] == ["applied"] * 4 and syncs == []
    assert all(ex.journal.is_done(f"w{b}") for b in range(4)) and ex.stats().num_group_commits == 0
    assert [bytes(ex.read(b) or b"") for b in range(4)] == [payload(b, 2000) for b in range(4)]
    ex.sync()
    assert len(syncs) == 1  # one slab file, once
    ex.sync()
    assert len(syncs) == 1  # nothing written since
    out = ex.apply([Decision("g9", 0, 9, "promote", "remote", "nvme")])
    assert out[0].status == "applied" and ex.stats().num_group_commits == 1 and len(syncs) == 2
    ex.apply([Decision("w9", 0, 9, "promote", "nvme", "dram")])
    ex.apply([Decision("x9", 0, 9, "demote", "dram", "nvme")])  # written back, not synced
    assert len(syncs) == 2
    ex.close()
    assert len(syncs) == 3  # close syncs what was written back
    monkeypatch.undo()
    again = Executor(
        [
            MemoryTier("dram", MemoryTierParams(capacity_bytes=1 << 20)),
            _tier(tmp_path / "nvme"),
            DirectoryTier(
                "remote", DirectoryTierParams(capacity_bytes=1 << 20, root=tmp_path / "r")
            ),
        ],
        ExecutorParams(state_dir=tmp_path / "state"),
    )
    assert [again.locate(b) for b in (0, 1, 2, 3, 9)] == ["nvme"] * 5
    again.close()


def test_a_fifo_named_like_a_slab_is_ignored_not_opened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "slab-8192.dat")  # opening it for reading would wait for a writer
    tier = _tier(tmp_path)
    assert tier.recover(verify=True).num_blocks == 0
    tier.write(1, b"x" * 100)  # another slot size: its own slab file
    assert bytes(tier.read(1)) == b"x" * 100
    with pytest.raises(TierError, match="not a regular file"):
        tier.write(2, b"y" * 5000)  # this size's slab is the FIFO: refused, nothing left
    assert not tier.contains(2) and tier.used_bytes == 100
    tier.close()


def test_a_truncated_slab_and_a_header_declaring_too_much_are_handled(
    tmp_path: Path, payload: Payload
) -> None:
    tier = _tier(tmp_path, capacity_bytes=1 << 20)
    for block in range(3):
        tier.write(block, payload(block, 3000))
    slot = slot_bytes_for(3000)
    index2 = tier._where[tier._key(2)][1]
    index1 = tier._where[tier._key(1)][1]
    tier.close()
    path = _slab_file(tmp_path, 3000)
    # Block 1's header rewritten (valid CRC) to declare 8 GiB: more than the tier holds.
    forged = slab_module._pack_header(tier._key(1), 8 << 30, 0, 99, slab_module._COMMITTED)
    with open(path, "r+b") as f:
        f.seek(index1 * slot)
        f.write(forged)
    os.truncate(path, index2 * slot + 100)  # block 2's slot cut short: the file ends mid-slot
    again = _tier(tmp_path, capacity_bytes=1 << 20)
    report = again.recover(verify=True)
    assert again.contains(0) and not again.contains(1) and not again.contains(2)
    assert bytes(again.read(0)) == payload(0, 3000)
    assert (report.num_temp_files_removed, report.quarantined) == (1, [])  # the forged slot freed
    again.write(5, payload(5, 3000))  # the tier keeps working past the cut
    assert bytes(again.read(5)) == payload(5, 3000)
    again.close()


def test_a_slab_grows_by_at_most_its_byte_cap(
    tmp_path: Path, payload: Payload, monkeypatch: pytest.MonkeyPatch
) -> None:
    slot = slot_bytes_for(20_000)
    monkeypatch.setattr(slab_module, "_GROW_MAX_BYTES", 3 * slot)
    tier = _tier(tmp_path, grow_slots=64)
    tier.write(1, payload(1, 20_000))
    assert _slab_file(tmp_path, 20_000).stat().st_size == 3 * slot  # not 64 slots
    monkeypatch.setattr(slab_module, "_GROW_MAX_BYTES", slot // 2)  # a slot bigger than the cap
    for block in range(2, 5):
        tier.write(block, payload(block, 20_000))
    assert _slab_file(tmp_path, 20_000).stat().st_size == 4 * slot  # then one at a time
    tier.close()


def test_large_slots_are_freed_at_the_next_sync_allocation_or_close(
    tmp_path: Path, payload: Payload, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A discarded large slot's header is zeroed later (a buffered write would wait for
    the file's direct reads): not reused before, zeroed by sync, by an allocation that
    needs a slot, or by close."""
    monkeypatch.setattr(slab_module, "_DEFERRED_FREE_BYTES", slot_bytes_for(50_000))
    tier = _tier(tmp_path, grow_slots=2)
    for block in (1, 2):
        tier.write(block, payload(block, 50_000))
    tier.write(9, payload(9, 1_000))  # a small slot: freed at once
    assert tier.discard(1) and tier.discard(9)
    assert not tier.contains(1) and tier.used_bytes == 50_000
    slab = tier._slabs[slot_bytes_for(50_000)]
    assert len(tier._to_free) == 1 and slab.free == []  # queued, not reusable yet
    tier.sync()
    assert tier._to_free == [] and len(slab.free) == 1
    tier.discard(2)
    tier.write(3, payload(3, 50_000))  # takes the slot sync freed
    tier.write(4, payload(4, 50_000))  # needs one more: frees the queued one first
    assert _slab_file(tmp_path, 50_000).stat().st_size == 2 * slot_bytes_for(50_000)
    tier.discard(3)
    tier.close()  # frees what is queued
    again = _tier(tmp_path, grow_slots=2)
    assert again.recover(verify=True).num_blocks == 1 and again.contains(4)
    assert bytes(again.read(4)) == payload(4, 50_000)
    again.close()
