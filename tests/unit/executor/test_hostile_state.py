"""What a broken or hostile disk state does to the executor: every case is handled
per block, start-up always completes, nothing valid is lost.

Real files in temp dirs: FIFOs and devices planted in a tier, a sparse file that
declares 8 GiB, a read-only tier (``chattr +i`` as root, ``chmod`` otherwise), a
malformed journal, a journal move from a tier to itself, and the promote that used to
demote its own block to make room (leaving an orphan copy)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from executor import Decision, Executor, ExecutorParams, block_key
from executor.tier import checksum
from executor.tiers.directory import (
    _HEADER,
    HEADER_BYTES,
    DirectoryTier,
    DirectoryTierParams,
)
from executor.tiers.memory import MemoryTier, MemoryTierParams

Payload = Callable[[int | str, int], bytes]
KB = 1024
GIB = 1 << 30


def _disk(root: Path, name: str = "nvme", cap: int = 1 << 20) -> DirectoryTier:
    return DirectoryTier(name, DirectoryTierParams(capacity_bytes=cap, root=root, fsync=False))


def _executor(root: Path, *, dram_kb: int, nvme_kb: int) -> Executor:
    tiers = [
        MemoryTier("dram", MemoryTierParams(capacity_bytes=dram_kb * KB)),
        _disk(root / "nvme", "nvme", nvme_kb * KB),
        _disk(root / "remote", "remote", 1 << 30),
    ]
    return Executor(tiers, ExecutorParams(state_dir=root / "state", fsync_journal=False))


def _in_thread(fn: Callable[[], object], timeout_s: float = 30.0) -> object:
    """Run ``fn`` in a thread; a hang fails the test instead of hanging the suite."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{fn} hung"
    return result[0] if result else None


def _holders(ex: Executor, root: Path, key: str) -> list[str]:
    """Every tier holding a copy of ``key``: memory by its index, disks by their files."""
    found = ["dram"] if ex.tier("dram").contains(key) else []
    return found + [t for t in ("nvme", "remote") if (root / t / key).exists()]


def test_a_promote_into_a_full_tier_is_refused_and_leaves_one_copy_of_each_block(
    tmp_path: Path, payload: Payload
) -> None:
    # dram holds two 8 KB blocks, nvme two; both are full. Promoting block 1 to dram
    # once made the executor demote dram's LRU into a full nvme whose LRU was block 1
    # itself (an orphan copy). The executor no longer evicts: the promote is refused
    # (the planner chooses victims) and every block keeps exactly one copy.
    ex = _executor(tmp_path, dram_kb=16, nvme_kb=16)
    for block, tier in ((1, "nvme"), (2, "nvme"), (10, "dram"), (11, "dram")):
        assert ex.write(block, payload(block, 8 * KB), tier).status == "applied"
    out = ex.apply_one(Decision("p1", 0, 1, "promote", "nvme", "dram"))
    assert out.status == "refused_full", out
    assert ex.locate(1) == "nvme"
    for block in (1, 2, 10, 11):
        key = block_key(block)
        assert _holders(ex, tmp_path, key) == [ex.locate(block)], f"block {block}"
        assert bytes(ex.read(block) or b"") == payload(block, 8 * KB)
    for name in ("dram", "nvme", "remote"):
        tier = ex.tier(name)
        assert tier.used_bytes == sum(tier.size_of(k) or 0 for k in tier.block_keys())
        assert tier.used_bytes <= tier.capacity_bytes
    ex.close()


def test_a_fifo_planted_at_a_block_path_is_a_miss_not_a_hang(
    tmp_path: Path, payload: Payload
) -> None:
    ex = _executor(tmp_path, dram_kb=64, nvme_kb=64)
    for block in (1, 2):
        assert ex.write(block, payload(block, 4 * KB), "nvme").status == "applied"
    path = tmp_path / "nvme" / block_key(1)
    path.unlink()
    os.mkfifo(path)
    assert _in_thread(lambda: ex.read(1)) is None
    assert ex.locate(1) is None and ex.tier("nvme").quarantined == [block_key(1)]
    # The stripe lock was released: the other block (and block 1's key) still work.
    assert bytes(_in_thread(lambda: ex.read(2)) or b"") == payload(2, 4 * KB)  # type: ignore[arg-type]
    ex.close()
    # A FIFO present at start-up is quarantined too, without blocking recovery.
    os.mkfifo(tmp_path / "nvme" / block_key(3))
    reopened = _in_thread(lambda: _executor(tmp_path, dram_kb=64, nvme_kb=64))
    assert isinstance(reopened, Executor)
    assert block_key(3) in reopened.last_recovery.quarantined["nvme"]
    assert reopened.locate(2) == "nvme"
    reopened.close()


def test_a_device_node_in_a_tier_is_never_opened(tmp_path: Path) -> None:
    target = tmp_path / "nvme" / block_key(4)
    target.parent.mkdir(parents=True)
    try:
        os.mknod(target, stat.S_IFCHR | 0o644, os.makedev(1, 3))  # like /dev/null
    except (PermissionError, OSError) as exc:
        pytest.skip(f"cannot create a device node here: {exc}")
    tier = _disk(target.parent)
    assert not tier.contains(4) and block_key(4) in tier.recover().quarantined


def _sparse_block(path: Path, length: int) -> None:
    """A file whose header declares ``length`` bytes and whose size matches, all hole."""
    with open(path, "wb") as f:
        f.write(_HEADER.pack(b"KVWB", 1, length, 0))
        f.truncate(HEADER_BYTES + length)


def test_a_sparse_file_declaring_8_gib_is_quarantined_without_allocating(
    tmp_path: Path, payload: Payload
) -> None:
    root = tmp_path / "nvme"
    tier = _disk(root, cap=1 << 20)
    tier.write(1, payload(1, 1000))
    _sparse_block(root / block_key(2), 8 * GIB)
    for verify in (False, True):
        reopened = _disk(root, cap=1 << 20)
        report = reopened.recover(verify=verify)
        assert block_key(2) in report.quarantined
        assert reopened.block_keys() == [block_key(1)]
        assert reopened.used_bytes == 1000 and reopened.free_bytes == (1 << 20) - 1000
        _sparse_block(root / block_key(2), 8 * GIB)  # plant it again for the next pass
    # Planted while running: read refuses it before allocating 8 GiB.
    reopened._index(block_key(2), 8 * GIB)
    with pytest.raises(Exception, match="more than the tier's capacity"):
        reopened.read(2)


def test_free_bytes_is_never_negative_when_a_tier_starts_over_capacity(
    tmp_path: Path, payload: Payload
) -> None:
    root = tmp_path / "nvme"
    tier = _disk(root, cap=10_000)
    for block in range(3):
        tier.write(block, payload(block, 3000))
    smaller = _disk(root, cap=5000)  # capacity lowered in the config: nothing dropped
    assert smaller.used_bytes == 9000 and smaller.free_bytes == 0
    assert [bytes(smaller.read(b)) for b in range(3)] == [payload(b, 3000) for b in range(3)]


@contextmanager
def _read_only(path: Path) -> Iterator[None]:
    """Make ``path`` unwritable for this process for real, or skip the test."""
    if os.geteuid() == 0:
        if shutil.which("chattr") is None:
            pytest.skip("running as root without chattr: cannot make a read-only directory")
        subprocess.run(["chattr", "+i", str(path)], check=False, capture_output=True)
        undo = ["chattr", "-i", str(path)]
    else:
        path.chmod(0o555)
        undo = ["chmod", "755", str(path)]
    try:
        probe = path / ".probe"
        try:
            probe.write_bytes(b"")
            probe.unlink()
            pytest.skip(f"cannot make {path} read-only on this filesystem")
        except OSError:
            pass
        yield
    finally:
        subprocess.run(undo, check=False, capture_output=True)


def test_a_read_only_tier_with_a_corrupt_block_starts_and_serves_the_rest(
    tmp_path: Path, payload: Payload
) -> None:
    root = tmp_path / "remote"
    tier = _disk(root, "remote")
    for block in range(4):
        tier.write(block, payload(block, 2000))
    with open(root / block_key(1), "r+b") as f:  # bit rot in one block
        f.seek(HEADER_BYTES + 7)
        f.write(b"\xff\xfe")
    shutil.rmtree(root / ".tmp")  # a read-only mount need not have our temp dir
    with _read_only(root):
        tiers = [_disk(root, "remote")]
        ex = Executor(tiers, ExecutorParams(state_dir=tmp_path / "state"))
        assert ex.last_recovery.quarantined == {"remote": [block_key(1)]}
        assert (root / block_key(1)).exists()  # could not be moved aside: left, ignored
        assert ex.read(1) is None
        for block in (0, 2, 3):
            assert bytes(ex.read(block) or b"") == payload(block, 2000)
        out = ex.write(9, payload(9, 10), "remote")
        assert out.status == "failed"
        ex.close()
        again = _disk(root, "remote")  # a second start finds and ignores it again
        assert block_key(1) in again.recover(verify=True).quarantined
        assert sorted(again.block_keys()) == [block_key(b) for b in (0, 2, 3)]


def test_a_malformed_journal_record_is_quarantined_not_fatal(
    tmp_path: Path, payload: Payload
) -> None:
    ex = _executor(tmp_path, dram_kb=64, nvme_kb=64)
    ex.write(1, payload(1, 1000), "remote")
    assert ex.apply_one(Decision("good-1", 0, 1, "promote", None, "nvme")).status == "applied"
    ex.close()
    journal = tmp_path / "state" / "journal.jsonl"
    bad_lines = [
        b'{"b": "m1"}',  # a move without key or tiers
        b'{"d": ["not", "a", "string"], "s": "applied"}',
        b'{"p": "0000000000000001", "on": "yes"}',
        b"[1, 2, 3]",
        b"\xff\xfe not json",
        b'{"z": 1}',
        b"[" * 5000,  # deep nesting
    ]
    with open(journal, "ab") as f:
        f.write(b"\n".join(bad_lines) + b"\n")
        f.write(b'{"d":"good-2","s":"applied"}\n')
    reopened = _executor(tmp_path, dram_kb=64, nvme_kb=64)
    assert reopened.last_recovery.num_malformed_journal_records == len(bad_lines)
    quarantine = (tmp_path / "state" / "journal.jsonl.quarantine").read_bytes()
    assert quarantine.count(b"\n") == len(bad_lines)
    # The good records before and after the bad ones still count.
    assert reopened.journal.is_done("good-1") and reopened.journal.is_done("good-2")
    assert reopened.locate(1) == "nvme"
    assert bytes(reopened.read(1) or b"") == payload(1, 1000)
    reopened.close()


def test_a_journal_move_from_a_tier_to_itself_never_deletes_the_only_copy(
    tmp_path: Path, payload: Payload
) -> None:
    ex = _executor(tmp_path, dram_kb=64, nvme_kb=64)
    ex.write(5, payload(5, 1000), "nvme")
    ex.close()
    key = block_key(5)
    record = {"b": "self", "k": key, "f": "nvme", "t": "nvme"}
    with open(tmp_path / "state" / "journal.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    reopened = _executor(tmp_path, dram_kb=64, nvme_kb=64)
    assert reopened.locate(5) == "nvme"
    assert bytes(reopened.read(5) or b"") == payload(5, 1000)
    assert reopened.last_recovery.num_malformed_journal_records == 1
    with pytest.raises(ValueError, match="source and destination"):
        reopened.journal.begin_move("again", key, "nvme", "nvme")
    reopened.close()


def test_a_torn_journal_tail_is_cut_so_the_next_record_stands_alone(tmp_path: Path) -> None:
    ex = _executor(tmp_path, dram_kb=64, nvme_kb=64)
    ex.close()
    journal = tmp_path / "state" / "journal.jsonl"
    with open(journal, "ab") as f:
        f.write(b'{"d":"torn","s":"app')  # killed mid-append
    from executor.journal import Journal

    j = Journal(journal, fsync=False)
    assert j.num_torn_lines == 1 and j.num_malformed_records == 0
    j.decision_done("next", "applied")
    j.close()
    assert Journal(journal, fsync=False).is_done("next")


def test_checksum_of_parts_combines_to_the_whole(tmp_path: Path) -> None:
    from executor.crc import combine

    data = os.urandom(300_000)
    for cut in (0, 1, 4096, 123_457, 300_000):
        a, b = data[:cut], data[cut:]
        assert combine(checksum(a), checksum(b), len(b)) == checksum(data)


@pytest.mark.parametrize("direct_reads", [True, False])
def test_parallel_part_reads_return_the_same_bytes(tmp_path: Path, direct_reads: bool) -> None:
    params = DirectoryTierParams(
        capacity_bytes=1 << 26,
        root=tmp_path / "nvme",
        fsync=False,
        read_parts=4,
        min_part_bytes=4096,
        direct_reads=direct_reads,
    )
    tier = DirectoryTier("nvme", params)
    data = os.urandom((3 << 20) + 123)  # not a multiple of the part size
    tier.write(1, data)
    assert len(tier._parts(len(data))) == 4
    got, crc = tier.read_with_checksum(1)
    assert bytes(got) == data and crc == checksum(data)
    with open(tier.root / block_key(1), "r+b") as f:  # corrupt the last part only
        f.seek(HEADER_BYTES + len(data) - 5)
        f.write(b"\x00\x01\x02")
    with pytest.raises(Exception, match="crc32c mismatch"):
        tier.read(1)
    tier.close()


def test_a_fifo_in_place_of_the_journal_is_set_aside_not_read(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    os.mkfifo(tmp_path / "state" / "journal.jsonl")
    ex = _in_thread(lambda: _executor(tmp_path, dram_kb=64, nvme_kb=64))
    assert isinstance(ex, Executor)
    assert ex.apply_one(Decision("after", 0, 1, "evict")).reason == "not cached"
    ex.close()
    names = sorted(p.name for p in (tmp_path / "state").iterdir())
    assert names[0] == "journal.jsonl" and names[1].startswith("journal.jsonl.not-a-file.")
