"""Journal group commit: one fsync per batch, and still exactly-once across SIGKILLs
that land anywhere inside a batch."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from executor import Decision, Executor, ExecutorParams
from executor.tiers.directory import DirectoryTier, DirectoryTierParams
from executor.tiers.memory import MemoryTier, MemoryTierParams

WORKER = Path(__file__).with_name("group_commit_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[3]
NUM_BLOCKS = 80
NUM_MOVES = 1280  # 20 batches of 64
SEED = 5

Payload = Callable[[int | str, int], bytes]


def _executor(root: Path, group_commit: bool) -> Executor:
    tiers = [
        MemoryTier("dram", MemoryTierParams(capacity_bytes=1 << 20)),
        DirectoryTier(
            "nvme", DirectoryTierParams(capacity_bytes=1 << 20, root=root / "nvme", fsync=False)
        ),
    ]
    params = ExecutorParams(state_dir=root / "state", fsync_journal=True, group_commit=group_commit)
    return Executor(tiers, params)


@pytest.mark.parametrize("group_commit", [True, False])
def test_one_journal_fsync_per_batch(tmp_path: Path, payload: Payload, group_commit: bool) -> None:
    ex = _executor(tmp_path, group_commit)
    for block in range(40):
        ex.write(block, payload(block, 1000), "nvme")
    before = ex.journal.num_fsyncs
    batch = [Decision(f"p{b}", 0, b, "promote", "nvme", "dram") for b in range(40)]
    assert {o.status for o in ex.apply(batch)} == {"applied"}
    # Per record: a begin and a done per move. Group commit: one for the batch.
    assert ex.journal.num_fsyncs - before == (1 if group_commit else 80)
    ex.sync()  # nothing new since: no second fsync
    assert ex.journal.num_fsyncs - before == (1 if group_commit else 80)
    ex.close()


def _spawn(root: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(root), str(SEED), str(NUM_BLOCKS), str(NUM_MOVES)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # The worker imports this checkout's executor, whatever is installed.
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )


def _seed_blocks(root: Path, worker, payload: Payload) -> None:
    ex = worker.open_executor(root)
    for block in range(NUM_BLOCKS):
        assert ex.write(block, payload(block, worker.block_size(block)), "remote").status == (
            "applied"
        )
    ex.close()


def _run_to_end(root: Path) -> dict:
    proc = _spawn(root)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_sigkill_inside_a_batch_applies_every_decision_exactly_once(
    load_worker, tmp_path: Path, payload: Payload
) -> None:
    worker = load_worker(WORKER)
    clean_root, killed_root = tmp_path / "clean", tmp_path / "killed"
    _seed_blocks(clean_root, worker, payload)
    _seed_blocks(killed_root, worker, payload)

    started = time.perf_counter()
    clean = _run_to_end(clean_root)
    batch_s = (time.perf_counter() - started) / (NUM_MOVES / worker.BATCH)
    assert sum(clean["statuses"].values()) == NUM_MOVES and "failed" not in clean["statuses"]
    assert clean["fsyncs"] <= NUM_MOVES // worker.BATCH + 1  # one per batch (+ close)

    rng = random.Random(77)
    num_mid_batch = 0
    for _ in range(6):
        proc = _spawn(killed_root)
        assert proc.stdout is not None
        # Wait for a random batch to start, then kill a random fraction of a batch later.
        target = rng.randint(0, 4)
        line = ""
        while not line.startswith(f"start {target}"):
            line = proc.stdout.readline()
            if not line:
                break
        time.sleep(rng.uniform(0, batch_s))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            num_mid_batch += 1
        proc.communicate(timeout=60)
        # After each kill: every block exactly once, readable, checksum valid.
        ex = worker.open_executor(killed_root)
        assert ex.last_recovery.quarantined == {} and ex.last_recovery.moves_lost == []
        for block in range(NUM_BLOCKS):
            holders = [t for t in worker.TIERS if ex.tier(t).contains(block)]
            assert len(holders) == 1, f"block {block} in {holders}"
            assert bytes(ex.read(block) or b"") == payload(block, worker.block_size(block))
        ex.close()
    assert num_mid_batch >= 4, "the kills should land while batches run"

    # Redelivery of everything: what was done is skipped as a duplicate, the rest runs.
    # Exactly once: the final placement is the clean run's (a decision applied twice,
    # or lost, would leave some block elsewhere), and every id is remembered.
    final = _run_to_end(killed_root)
    assert "failed" not in final["statuses"]
    assert final["placement"] == clean["placement"]
    ex = worker.open_executor(killed_root)
    todo = worker.decisions(SEED, NUM_BLOCKS, NUM_MOVES)
    assert all(ex.journal.is_done(d.decision_id) for d in todo)
    ex.close()
