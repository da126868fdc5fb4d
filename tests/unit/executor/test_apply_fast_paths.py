"""The executor's cheap paths: small moves between host-memory tiers run in the
caller's thread, the journal fsync can be left to the caller's sync() (serve's sink
does it at flush), and the engine stand-in's stores share one zero payload."""

from __future__ import annotations

import threading
from pathlib import Path

from executor import Decision, Executor, ExecutorParams
from executor.tiers.directory import DirectoryTier, DirectoryTierParams
from executor.tiers.memory import MemoryTier, MemoryTierParams
from serving.decisions import ExecutorSink


class _RecordingMemoryTier(MemoryTier):
    """Remembers the thread of each commit."""

    def __init__(self, name: str, params: MemoryTierParams) -> None:
        super().__init__(name, params)
        self.threads: list[str] = []

    def _commit(self, key: str, data: bytes | bytearray | memoryview, crc: int | None) -> None:
        self.threads.append(threading.current_thread().name)
        super()._commit(key, data, crc)


def _executor(root: Path, **params: object) -> tuple[Executor, _RecordingMemoryTier]:
    dram = _RecordingMemoryTier("dram", MemoryTierParams(capacity_bytes=1 << 24))
    tiers = [
        MemoryTier("hbm", MemoryTierParams(capacity_bytes=1 << 24)),
        dram,
        DirectoryTier("nvme", DirectoryTierParams(capacity_bytes=1 << 24, root=root / "nvme")),
    ]
    ex = Executor(tiers, ExecutorParams(state_dir=root / "state", **params))  # type: ignore[arg-type]
    return ex, dram


def test_memory_moves_run_in_the_callers_thread_disk_moves_in_the_pool(tmp_path: Path) -> None:
    ex, dram = _executor(tmp_path)
    for block in range(4):
        assert ex.store(block, "hbm", 4096).status == "applied"
        assert ex.store(10 + block, "nvme", 4096).status == "applied"
    dram.threads.clear()
    batch = [Decision(f"m{b}", 0, b, "demote", "hbm", "dram") for b in range(4)]
    batch += [Decision(f"d{b}", 0, 10 + b, "promote", "nvme", "dram") for b in range(4)]
    assert [o.status for o in ex.apply(batch)] == ["applied"] * 8
    caller = threading.current_thread().name
    assert dram.threads.count(caller) == 4  # the hbm -> dram demotes
    assert sum(t.startswith("kvwarm-nvme") for t in dram.threads) == 4
    ex.close()


def test_apply_leaves_the_fsync_to_sync_when_asked(tmp_path: Path) -> None:
    ex, _ = _executor(tmp_path, fsync_journal=True, group_commit=True)
    for block in range(8):
        ex.store(block, "hbm", 1024)
    ex.sync_each_apply = False
    before = ex.journal.num_fsyncs
    batch = [Decision(f"m{b}", 0, b, "demote", "hbm", "dram") for b in range(8)]
    assert {o.status for o in ex.apply(batch)} == {"applied"}
    assert ex.journal.num_fsyncs == before
    ex.sync()
    assert ex.journal.num_fsyncs == before + 1
    assert all(ex.journal.is_done(d.decision_id) for d in batch)
    ex.close()


def test_executor_sink_syncs_the_journal_at_flush_not_per_batch(tmp_path: Path) -> None:
    ex, _ = _executor(tmp_path, fsync_journal=True, group_commit=True)
    sink = ExecutorSink(ex, block_size_bytes=1024)
    for block in range(6):
        sink.place_store(block, "hbm", 0)
    before = ex.journal.num_fsyncs
    for b in range(6):
        sink.emit([Decision(f"m{b}", 0, b, "demote", "hbm", "dram")])
    assert ex.journal.num_fsyncs == before
    sink.flush()
    assert ex.journal.num_fsyncs == before + 1
    assert sink.outcomes[("demote", "applied")] == 6
    sink.close()


def test_stores_share_one_verified_zero_payload(tmp_path: Path) -> None:
    ex, _ = _executor(tmp_path)
    for block, tier in ((1, "hbm"), (2, "dram"), (3, "nvme")):
        assert ex.store(block, tier, 5000).status == "applied"
    for block in (1, 2, 3):  # dram and nvme verify their CRC32C on read
        assert bytes(ex.read(block) or b"x") == bytes(5000)
    assert ex.tier("hbm").read(1) is ex.tier("dram").read(2)
    ex.close()


def test_a_large_discarded_block_leaves_its_name_at_once_and_its_file_by_close(
    tmp_path: Path,
) -> None:
    tier = DirectoryTier("nvme", DirectoryTierParams(capacity_bytes=1 << 24, root=tmp_path))
    big = bytes(range(256)) * (4 << 12)  # 4 MiB: unlinked in the background
    tier.write(1, big)
    tier.write(2, b"small")
    assert tier.discard(1) and tier.discard(2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".quarantine", ".tmp"]
    assert not tier.contains(1) and tier.used_bytes == 0
    tier.write(1, b"again")  # the name is free for a new copy at once
    tier.close()
    assert list((tmp_path / ".tmp").iterdir()) == []
    # One left behind by a crash before its unlink is a temp file: recover removes it.
    (tmp_path / ".tmp" / "0000000000000003.abc.discarded").write_bytes(b"x" * 100)
    reopened = DirectoryTier("nvme", DirectoryTierParams(capacity_bytes=1 << 24, root=tmp_path))
    assert reopened.recover().num_temp_files_removed == 1
    assert reopened.block_keys() == ["0000000000000001"]
    reopened.close()
