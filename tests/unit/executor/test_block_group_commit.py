"""Group commit of block files: an ``apply`` batch's moves into a directory tier are
written first, made durable together (one directory fsync per group) and only then
journaled done; a SIGKILL anywhere inside that leaves no torn block, and redelivery
applies every decision exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from executor import Decision, Executor, ExecutorParams
from executor.tiers.directory import DirectoryTier, DirectoryTierParams
from executor.tiers.memory import MemoryTier, MemoryTierParams

WORKER = Path(__file__).with_name("block_group_commit_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[3]

Payload = Callable[[int | str, int], bytes]


def _executor(root: Path, **params: object) -> Executor:
    tiers = [
        MemoryTier("dram", MemoryTierParams(capacity_bytes=1 << 22)),
        DirectoryTier("nvme", DirectoryTierParams(capacity_bytes=1 << 22, root=root / "nvme")),
    ]
    return Executor(tiers, ExecutorParams(state_dir=root / "state", **params))  # type: ignore[arg-type]


@pytest.mark.parametrize("group_commit", [True, False])
def test_a_batch_of_demotes_is_one_group(
    tmp_path: Path, payload: Payload, group_commit: bool
) -> None:
    ex = _executor(tmp_path, group_commit_writes=group_commit)
    for block in range(10):
        assert ex.write(block, payload(block, 3000), "dram").status == "applied"
    batch = [Decision(f"d{b}", 0, b, "demote", "dram", "nvme") for b in range(10)]
    assert [o.status for o in ex.apply(batch)] == ["applied"] * 10
    stats = ex.stats()
    assert (stats.num_group_commits, stats.num_group_committed_writes) == (
        (1, 10) if group_commit else (0, 0)
    )
    assert stats.bytes_moved == {("dram", "nvme"): 30_000}
    assert all(ex.journal.is_done(d.decision_id) for d in batch)
    for block in range(10):
        assert ex.locate(block) == "nvme"
        assert bytes(ex.read(block) or b"") == payload(block, 3000)
    assert ex.tier("dram").used_bytes == 0 and ex.tier("nvme").used_bytes == 30_000
    assert list((tmp_path / "nvme" / ".tmp").iterdir()) == []
    ex.close()


def test_same_block_twice_in_a_batch_moves_in_order(tmp_path: Path, payload: Payload) -> None:
    """Only a block's last decision of a stretch is staged: the ones before it find
    the block where the previous one left it."""
    ex = _executor(tmp_path)
    ex.write(1, payload(1, 500), "dram")
    ex.write(2, payload(2, 500), "dram")
    batch = [
        Decision("x1", 0, 1, "demote", "dram", "nvme"),
        Decision("x2", 0, 2, "demote", "dram", "nvme"),
        Decision("x3", 0, 1, "promote", "nvme", "dram"),
        Decision("x4", 0, 1, "demote", "dram", "nvme"),
    ]
    assert [o.status for o in ex.apply(batch)] == ["applied"] * 4
    assert (ex.locate(1), ex.locate(2)) == ("nvme", "nvme")
    assert ex.stats().num_group_committed_writes == 2  # x2 and x4; x1 synced on its own
    ex.close()


def test_a_failed_group_write_leaves_the_block_in_its_source(
    tmp_path: Path, payload: Payload, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = _executor(tmp_path)
    for block in range(3):
        ex.write(block, payload(block, 800), "dram")
    nvme = ex.tier("nvme")
    assert isinstance(nvme, DirectoryTier)
    real = nvme._sync_file

    def failing(path: str) -> Exception | None:
        return OSError(5, "injected EIO") if "0000000000000001" in path else real(path)

    monkeypatch.setattr(nvme, "_sync_file", failing)
    batch = [Decision(f"f{b}", 0, b, "demote", "dram", "nvme") for b in range(3)]
    outcomes = ex.apply(batch)
    assert [o.status for o in outcomes] == ["applied", "failed", "applied"]
    assert "injected EIO" in outcomes[1].reason
    assert [ex.locate(b) for b in range(3)] == ["nvme", "dram", "nvme"]
    assert not ex.journal.is_done("f1") and "f1" not in ex.journal.pending
    assert nvme.used_bytes == 1600 and nvme.free_bytes == nvme.capacity_bytes - 1600
    assert sorted(p.name for p in (tmp_path / "nvme").iterdir() if p.is_file()) == [
        "0000000000000000",
        "0000000000000002",
    ]
    assert list((tmp_path / "nvme" / ".tmp").iterdir()) == []
    # Redelivered once the disk is well, it is applied (failures are not remembered).
    monkeypatch.undo()
    assert ex.apply([batch[1]])[0].status == "applied"
    ex.close()


def test_syncfs_commits_a_group(tmp_path: Path, payload: Payload) -> None:
    nvme = DirectoryTier(
        "nvme", DirectoryTierParams(capacity_bytes=1 << 20, root=tmp_path, sync_method="syncfs")
    )
    staged = [nvme.stage_write(b, payload(b, 700)) for b in range(4)]
    assert not nvme.contains(0) and nvme.free_bytes == (1 << 20) - 2800
    assert nvme.commit_staged(staged) == [None] * 4
    assert [bytes(nvme.read(b)) for b in range(4)] == [payload(b, 700) for b in range(4)]
    aborted = nvme.stage_write(9, b"x" * 100)
    nvme.abort_staged([aborted])
    assert not nvme.contains(9) and nvme.used_bytes == 2800 and nvme.free_bytes == (1 << 20) - 2800
    assert list((tmp_path / ".tmp").iterdir()) == []
    with pytest.raises(ValueError, match="fsync, syncfs"):
        DirectoryTierParams(capacity_bytes=1, root=tmp_path, sync_method="sync")
    nvme.close()


def _spawn(
    root: Path, kill_point: str, kind: str = "directory"
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(WORKER), str(root), kill_point, kind],
        capture_output=True,
        text=True,
        timeout=120,
        # The worker imports this checkout's executor, whatever is installed.
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )


def _seed(root: Path, worker, payload: Payload, kind: str = "directory") -> None:
    ex = worker.open_executor(root, kind)
    for block in range(worker.NUM_BLOCKS):
        assert ex.write(block, payload(block, worker.block_size(block)), "dram").status == (
            "applied"
        )
    ex.close()


def _allowed_tiers(worker, ex: Executor) -> dict[int, set[str]]:
    """Where each block may be after a kill: where its last decision journaled done
    put it (or "dram", where it started), or where a later decision, not journaled
    done, may have taken it (recovery finishes a move whose write was durable)."""
    allowed: dict[int, set[str]] = {}
    for block in range(worker.NUM_BLOCKS):
        mine = [d for batch in worker.decisions() for d in batch if d.block_hash == block]
        done = [i for i, d in enumerate(mine) if ex.journal.is_done(d.decision_id)]
        last = done[-1] if done else -1
        assert done == list(range(last + 1)), f"block {block}: done out of order {done}"
        allowed[block] = {mine[last].to_tier if done else "dram"}
        allowed[block] |= {d.to_tier for d in mine[last + 1 :]}
    return allowed


KILL_POINTS = [
    ("directory", "stage:5"),  # mid-staging of the first batch: nothing committed
    ("directory", "sync:4"),  # some files synced, none renamed
    ("directory", "rename:1"),  # the first rename of a group
    ("directory", "rename:7"),  # half the group's names visible, not yet durable
    ("directory", "dirsync:1"),  # the group durable, no move finished, nothing journaled done
    ("directory", "done:3"),  # the first group half finished
    ("directory", "done:14"),  # inside the second batch's finish
    ("directory", "rename:15"),  # inside the third batch's group
    ("slab", "stage:5"),  # mid-staging of the first batch: slots written, not synced
    ("slab", "stage:12"),  # the whole first group written, not synced
    ("slab", "sync:1"),  # the first group durable, no move finished
    ("slab", "done:3"),  # the first group half finished
    ("slab", "done:14"),  # inside the second batch's finish
    ("slab", "stage:15"),  # inside the third batch's group
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "kill_point"), KILL_POINTS)
def test_sigkill_inside_a_group_commit_loses_nothing_and_applies_once(
    load_worker, tmp_path: Path, payload: Payload, kind: str, kill_point: str
) -> None:
    worker = load_worker(WORKER)
    clean_root, killed_root = tmp_path / "clean", tmp_path / "killed"
    _seed(clean_root, worker, payload, kind)
    clean = _spawn(clean_root, "none", kind)
    assert clean.returncode == 0, clean.stderr
    expected = json.loads(clean.stdout.strip().splitlines()[-1])
    assert set(expected["statuses"]) == {"applied"}

    _seed(killed_root, worker, payload, kind)
    killed = _spawn(killed_root, kill_point, kind)
    assert killed.returncode == -9, f"the kill point {kill_point} was never reached"

    # Recovery: every block exactly once, whole (checksum verified), where the journal
    # allows; no temp file left, nothing quarantined or lost.
    ex = worker.open_executor(killed_root, kind)
    assert ex.last_recovery.quarantined == {} and ex.last_recovery.moves_lost == []
    allowed = _allowed_tiers(worker, ex)
    for block in range(worker.NUM_BLOCKS):
        holders = [t for t in worker.TIERS if ex.tier(t).contains(block)]
        assert len(holders) == 1, f"block {block} in {holders}"
        assert holders[0] in allowed[block], f"block {block} in {holders}, allowed {allowed[block]}"
        assert bytes(ex.read(block) or b"") == payload(block, worker.block_size(block))
    if kind == "directory":
        for name in worker.TIERS:
            assert list((killed_root / name / ".tmp").iterdir()) == []
    ex.close()

    # Redelivery of every batch: what was done is a duplicate, the rest runs; the end
    # state is the clean run's, and every decision id is remembered.
    final = _spawn(killed_root, "none", kind)
    assert final.returncode == 0, final.stderr
    summary = json.loads(final.stdout.strip().splitlines()[-1])
    assert "failed" not in summary["statuses"]
    assert summary["placement"] == expected["placement"]
    ex = worker.open_executor(killed_root, kind)
    assert all(ex.journal.is_done(d.decision_id) for batch in worker.decisions() for d in batch)
    ex.close()
