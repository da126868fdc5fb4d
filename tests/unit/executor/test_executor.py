"""The Executor: outcomes, idempotence across restarts, capacity, pins, budgets,
corruption as a miss, recovery of half-done moves, and racing decisions."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from executor import Decision, Executor, ExecutorParams, InvalidBlockIdError, block_key
from executor.tiers.directory import (
    HEADER_BYTES,
    DirectoryTier,
    DirectoryTierParams,
    RemoteDirectoryTier,
    RemoteDirectoryTierParams,
)
from executor.tiers.memory import MemoryTier, MemoryTierParams

Payload = Callable[[int | str, int], bytes]
KB = 1024
_ids = itertools.count()


def decide(
    block: int, action: str, to: str | None = None, src: str | None = None, **kw: object
) -> Decision:
    return Decision(f"t{next(_ids)}", 1, block, action, src, to, **kw)  # type: ignore[arg-type]


def make_executor(
    root: Path, *, dram_kb: int = 64, nvme_kb: int = 256, **params: object
) -> Executor:
    tiers = [
        MemoryTier("dram", MemoryTierParams(capacity_bytes=dram_kb * KB)),
        DirectoryTier(
            "nvme",
            DirectoryTierParams(capacity_bytes=nvme_kb * KB, root=root / "nvme", fsync=False),
        ),
        RemoteDirectoryTier(
            "remote",
            RemoteDirectoryTierParams(capacity_bytes=1 << 30, root=root / "remote", fsync=False),
        ),
    ]
    return Executor(tiers, ExecutorParams(state_dir=root / "state", fsync_journal=False, **params))  # type: ignore[arg-type]


def test_moves_report_each_outcome(tmp_path: Path, payload: Payload) -> None:
    ex = make_executor(tmp_path)
    assert ex.write(1, payload(1, 8 * KB), "remote").status == "applied"
    out = ex.apply_one(decide(1, "promote", "nvme"))
    assert (out.status, out.from_tier, out.to_tier, out.size_bytes) == (
        "applied",
        "remote",
        "nvme",
        8 * KB,
    )
    assert ex.locate(1) == "nvme" and not ex.tier("remote").contains(1)
    assert ex.apply_one(decide(1, "promote", "nvme")).reason == "already in nvme"
    assert (
        ex.apply_one(decide(1, "demote", "remote", src="dram")).reason
        == "block is in nvme, not dram"
    )
    assert ex.apply_one(decide(1, "promote", "remote")).reason == (
        "block is in nvme; promote to remote does not apply"
    )
    assert ex.apply_one(decide(1, "demote", "dram")).status == "stale"  # dram is faster than nvme
    missing = ex.apply_one(decide(2, "promote", "dram"))
    assert (missing.status, missing.reason) == ("missing", "not cached")
    failed = ex.apply_one(decide(1, "promote", "hbm"))
    assert (failed.status, failed.reason) == ("failed", "tier hbm is not configured")
    assert ex.apply_one(decide(1, "promote", "dram")).status == "applied"
    assert bytes(ex.read(1) or b"") == payload(1, 8 * KB)
    assert ex.apply_one(decide(1, "evict")).status == "applied"
    assert ex.locate(1) is None and ex.read(1) is None
    stats = ex.stats()
    assert stats.bytes_moved == {("remote", "nvme"): 8 * KB, ("nvme", "dram"): 8 * KB}
    assert stats.num_failed == 1
    ex.close()


def test_decision_ids_apply_once_even_across_restart(tmp_path: Path, payload: Payload) -> None:
    ex = make_executor(tmp_path)
    ex.write(5, payload(5, KB), "remote")
    promote = decide(5, "promote", "nvme")
    assert ex.apply_one(promote).status == "applied"
    assert ex.apply_one(promote).status == "duplicate"
    ex.close()
    again = make_executor(tmp_path)
    assert again.locate(5) == "nvme"
    assert again.apply_one(promote).status == "duplicate"
    again.close()


def test_promote_into_a_full_tier_is_refused_and_changes_nothing(
    tmp_path: Path, payload: Payload
) -> None:
    # The executor never picks a victim: the planner does, and sends the demote first.
    ex = make_executor(tmp_path, dram_kb=32)
    for block in range(4):
        ex.write(block, payload(block, 8 * KB), "dram")
    assert ex.apply_one(decide(2, "pin")).status == "applied"
    ex.write(9, payload(9, 16 * KB), "nvme")
    before = {b: ex.locate(b) for b in (0, 1, 2, 3, 9)}
    out = ex.apply_one(decide(9, "promote", "dram"))
    assert (out.status, out.reason) == ("refused_full", "no room in dram")
    assert {b: ex.locate(b) for b in (0, 1, 2, 3, 9)} == before
    assert ex.write(10, payload(10, 8 * KB), "dram").status == "refused_full"
    # The same promote after the planner's demotes, in one batch: applied in order.
    outs = ex.apply(
        [decide(1, "demote", "nvme"), decide(3, "demote", "nvme"), decide(9, "promote", "dram")]
    )
    assert [o.status for o in outs] == ["applied", "applied", "applied"]
    assert [ex.locate(b) for b in (0, 1, 2, 3, 9)] == ["dram", "nvme", "dram", "nvme", "dram"]
    assert ex.tier("dram").used_bytes <= ex.tier("dram").capacity_bytes
    pinned = ex.apply_one(decide(2, "demote", "nvme"))
    assert (pinned.status, pinned.reason) == ("refused_pinned", "pinned")
    ex.close()


def test_prefetch_budget_and_deadline_skip(tmp_path: Path, payload: Payload) -> None:
    ex = make_executor(
        tmp_path,
        prefetch_budget_bytes_per_s={"dram": 1000.0},
        prefetch_burst_bytes=0,
        max_budget_wait_ms=50,
    )
    ex.write(1, payload(1, 10 * KB), "nvme")
    out = ex.apply_one(decide(1, "promote", "dram"))
    assert (out.status, out.reason) == (
        "refused_budget",
        "prefetch bandwidth budget of dram exhausted",
    )
    late = ex.apply_one(decide(1, "promote", "dram", deadline_ms=5))
    assert (late.status, late.reason) == ("expired", "deadline passed")
    assert ex.locate(1) == "nvme"
    ex.close()


def test_corrupt_block_is_a_miss_and_reported(tmp_path: Path, payload: Payload) -> None:
    ex = make_executor(tmp_path)
    ex.write(3, payload(3, 4 * KB), "nvme")
    ex.write(4, payload(4, 4 * KB), "nvme")
    for block in (3, 4):
        path = tmp_path / "nvme" / block_key(block)
        raw = bytearray(path.read_bytes())
        raw[HEADER_BYTES + 7] ^= 0x01
        path.write_bytes(bytes(raw))
    assert ex.read(3) is None and ex.locate(3) is None
    out = ex.apply_one(decide(4, "promote", "dram"))
    assert out.status == "failed" and "corrupt" in out.reason and ex.locate(4) is None
    assert ex.stats().num_corrupt_reads == 2
    assert sorted(ex.tier("nvme").quarantined) == [block_key(3), block_key(4)]
    ex.close()


def test_recovery_quarantines_corrupt_blocks_at_start(tmp_path: Path, payload: Payload) -> None:
    ex = make_executor(tmp_path)
    ex.write(6, payload(6, 4 * KB), "remote")
    ex.write(7, payload(7, 4 * KB), "remote")
    ex.close()
    path = tmp_path / "remote" / block_key(6)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x80
    path.write_bytes(bytes(raw))
    again = make_executor(tmp_path)
    assert again.last_recovery.quarantined == {"remote": [block_key(6)]}
    assert again.locate(6) is None and again.locate(7) == "remote"
    again.close()


def _journal_begin(root: Path, move_id: str, block: int, src: str, dst: str) -> None:
    with open(root / "state" / "journal.jsonl", "a") as f:
        f.write(json.dumps({"b": move_id, "k": block_key(block), "f": src, "t": dst}) + "\n")


def test_recovery_finishes_or_rolls_back_half_done_moves(tmp_path: Path, payload: Payload) -> None:
    ex = make_executor(tmp_path)
    for block in (1, 2, 3):
        ex.write(block, payload(block, 4 * KB), "remote")
    ex.close()
    # 1: crashed after the rename, before discarding the source -> finish the move.
    nvme = DirectoryTier(
        "nvme", DirectoryTierParams(capacity_bytes=1 << 20, root=tmp_path / "nvme", fsync=False)
    )
    nvme.write(1, payload(1, 4 * KB))
    _journal_begin(tmp_path, "m1", 1, "remote", "nvme")
    # 2: crashed mid-copy: only a temp file at the destination -> roll back.
    (tmp_path / "nvme" / ".tmp" / f"{block_key(2)}.x").write_bytes(b"partial")
    _journal_begin(tmp_path, "m2", 2, "remote", "nvme")
    # 3: a duplicate the journal knows nothing of -> keep the fastest copy.
    nvme.write(3, payload(3, 4 * KB))
    with open(tmp_path / "state" / "journal.jsonl", "a") as f:
        f.write('{"b": "torn')
    again = make_executor(tmp_path)
    rec = again.last_recovery
    assert rec.moves_finished == ["m1"] and rec.moves_rolled_back == ["m2"]
    assert rec.duplicates_resolved == [f"{block_key(3)}@remote"]
    assert rec.num_torn_journal_lines == 1
    assert (again.locate(1), again.locate(2), again.locate(3)) == ("nvme", "remote", "nvme")
    for block in (1, 2, 3):
        assert bytes(again.read(block) or b"") == payload(block, 4 * KB)
        holders = [t for t in again.tier_names if again.tier(t).contains(block)]
        assert len(holders) == 1
    # The redelivered decision of the finished move is answered from state.
    assert again.apply_one(Decision("m1", 1, 1, "promote", "remote", "nvme")).status == "stale"
    again.close()


def test_racing_promote_and_demote_on_one_block_end_consistent(
    tmp_path: Path, payload: Payload
) -> None:
    ex = make_executor(tmp_path)
    data = payload(77, 16 * KB)
    ex.write(77, data, "remote")
    targets = [("promote", "dram"), ("promote", "nvme"), ("demote", "nvme"), ("demote", "remote")]
    errors: list[BaseException] = []

    def hammer(seed: int) -> None:
        try:
            for i in range(40):
                action, to = targets[(seed + i) % len(targets)]
                ex.apply_one(Decision(f"race-{seed}-{i}", 1, 77, action, None, to))  # type: ignore[arg-type]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    holders = [t for t in ex.tier_names if ex.tier(t).contains(77)]
    assert holders == [ex.locate(77)]
    assert bytes(ex.read(77) or b"") == data
    used = sum(ex.tier(t).used_bytes for t in ex.tier_names)
    assert used == 16 * KB
    ex.close()


def test_apply_batch_runs_in_parallel_and_keeps_per_block_order(
    tmp_path: Path, payload: Payload
) -> None:
    ex = make_executor(tmp_path, dram_kb=1024, nvme_kb=1024)
    for block in range(20):
        ex.write(block, payload(block, 4 * KB), "remote")
    batch = []
    for block in range(20):
        batch += [
            decide(block, "promote", "nvme"),
            decide(block, "promote", "dram"),
            decide(block, "demote", "nvme"),
        ]
    outcomes = ex.apply(batch)
    assert [o.decision_id for o in outcomes] == [d.decision_id for d in batch]
    assert all(o.status == "applied" for o in outcomes)
    assert all(ex.locate(block) == "nvme" for block in range(20))
    ex.close()


def test_hostile_ids_are_refused_by_the_executor(tmp_path: Path) -> None:
    ex = make_executor(tmp_path)
    for bad in ("../../etc/passwd", "/abs", "a\x00b", "z" * 300):
        with pytest.raises(InvalidBlockIdError, match="invalid block id"):
            ex.write(bad, b"x", "nvme")
        with pytest.raises(InvalidBlockIdError):
            ex.read(bad)
    assert sorted(p.name for p in (tmp_path / "nvme").iterdir()) == [".quarantine", ".tmp"]
    ex.close()


def test_journal_compacts_itself_and_keeps_ids_pins_and_pending(tmp_path: Path) -> None:
    from executor.journal import Journal

    journal = Journal(tmp_path / "j.jsonl", fsync=False, max_ids=3, compact_every=5)
    journal.begin_move("m0", "k0", "nvme", "dram")
    journal.set_pin("k9", True)
    for i in range(20):
        journal.decision_done(f"d{i}", "applied")
    lines = (tmp_path / "j.jsonl").read_text().splitlines()
    # 22 records appended; rewrites keep 3 ids + 1 pin + 1 pending, plus < 5 appended since.
    assert len(lines) < 3 + 1 + 1 + 5
    journal.close()
    reopened = Journal(tmp_path / "j.jsonl", fsync=False, max_ids=3)
    assert [d for d in ("d16", "d17", "d18", "d19") if reopened.is_done(d)] == ["d17", "d18", "d19"]
    assert reopened.pins == {"k9"} and list(reopened.pending) == ["m0"]
    reopened.close()


def test_a_compacted_journal_is_the_json_of_its_records(tmp_path: Path) -> None:
    """Compaction formats lines by hand: they must be what json.dumps gives, escapes
    included."""
    import json

    from executor.journal import Journal

    journal = Journal(tmp_path / "j.jsonl", fsync=False)
    ids = ["plain-1", 'quote"d', "back\\slash", "tab\tid", "é-unicode"]
    for i, did in enumerate(ids):
        journal.decision_done(did, "applied")
        journal.begin_move(f"m{i}", f"k{i}", "dram", "nvme")
    journal.set_pin("k9", True)
    journal.compact()
    expected = [{"d": d, "s": "done"} for d in ids]
    expected += [{"p": "k9", "on": True}]
    expected += [{"b": f"m{i}", "k": f"k{i}", "f": "dram", "t": "nvme"} for i in range(5)]
    text = (tmp_path / "j.jsonl").read_text()
    assert text == "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in expected)
    journal.close()


def test_a_duplicate_arriving_while_the_first_is_journalled_is_not_applied_again(
    tmp_path: Path, payload: Payload
) -> None:
    """The window between a decision's move and its done record: a duplicate of it
    arriving there (another thread's apply) must find the id in flight. Simulated by
    delivering the duplicate from inside the journal's done call."""
    ex = make_executor(tmp_path)
    assert ex.write(1, payload(1, 8 * KB), "nvme").status == "applied"
    decision = decide(1, "promote", "dram")
    seen: list[str] = []
    done = ex.journal.decision_done

    def duplicate_arrives(did: str, status: str) -> None:
        if not seen:
            seen.append(ex.apply_one(decision).status)
        done(did, status)

    ex.journal.decision_done = duplicate_arrives  # type: ignore[method-assign]
    assert ex.apply_one(decision).status == "applied"
    assert seen == ["duplicate"]
    assert ex.locate(1) == "dram"
