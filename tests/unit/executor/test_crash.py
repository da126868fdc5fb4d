"""Crash injection: a subprocess applying 1,000 moves is SIGKILLed at random points;
after each recovery every block exists exactly once, in a tier the decisions allow,
with a valid checksum. Then the moves run to the end, each decision applied once."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor import TIER_RANK, block_key

WORKER = Path(__file__).with_name("crash_worker.py")
NUM_BLOCKS = 120
NUM_MOVES = 1000
SEED = 11


def _spawn(root: Path, kind: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            str(WORKER),
            str(root),
            str(SEED),
            str(NUM_BLOCKS),
            str(NUM_MOVES),
            kind,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _check_invariants(root: Path, worker, payload, allowed: dict[int, set[str]], kind: str) -> None:
    executor = worker.open_executor(root, kind)  # runs recovery
    try:
        assert executor.last_recovery.quarantined == {}, "a kill must never corrupt a block"
        assert executor.last_recovery.moves_lost == []
        for block in range(NUM_BLOCKS):
            key = block_key(block)
            if kind == "directory":
                files = [t for t in worker.TIERS if (root / t / key).exists()]
            else:  # the slab tiers' index, rebuilt from their slots' headers
                files = [t for t in worker.TIERS if executor.tier(t).contains(key)]
            assert len(files) == 1, f"block {block} is in {files} after recovery"
            assert executor.locate(block) == files[0]
            assert files[0] in allowed[block], (
                f"block {block} in {files[0]}, allowed {allowed[block]}"
            )
            data = executor.read(block)
            assert data is not None and bytes(data) == payload(block, worker.block_size(block))
        for name in worker.TIERS:
            tier = executor.tier(name)
            assert tier.used_bytes <= tier.capacity_bytes
            if (root / name / ".tmp").exists():
                assert list((root / name / ".tmp").iterdir()) == []
    finally:
        executor.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["directory", "slab"])
def test_sigkill_at_random_points_loses_nothing(
    load_worker, tmp_path: Path, payload, kind: str
) -> None:
    worker = load_worker(WORKER)
    todo = worker.decisions(SEED, NUM_BLOCKS, NUM_MOVES)
    # A block may be in remote (where it starts), in any tier a decision sends it to,
    # or below such a tier (demoted to make room).
    allowed = {b: {"remote"} for b in range(NUM_BLOCKS)}
    for d in todo:
        allowed[d.block_hash] |= {t for t in worker.TIERS if TIER_RANK[t] >= TIER_RANK[d.to_tier]}
    executor = worker.open_executor(tmp_path, kind)
    for block in range(NUM_BLOCKS):
        assert (
            executor.write(block, payload(block, worker.block_size(block)), "remote").status
            == "applied"
        )
    executor.close()

    rng = random.Random(2024)
    num_killed = 0
    for _ in range(8):
        proc = _spawn(tmp_path, kind)
        assert proc.stdout is not None
        # Let it get through a random number of batches, then kill it a random
        # fraction of a batch later: kills land mid-move, mid-journal, mid-demote.
        for _ in range(rng.randint(2, 12)):
            if not proc.stdout.readline():
                break
        time.sleep(rng.uniform(0, 0.01))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            num_killed += 1
        proc.communicate(timeout=60)
        _check_invariants(tmp_path, worker, payload, allowed, kind)
    assert num_killed >= 6, "the kills should land while moves are running"

    proc = _spawn(tmp_path, kind)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert "failed" not in summary, summary
    assert sum(summary.values()) == NUM_MOVES
    _check_invariants(tmp_path, worker, payload, allowed, kind)
    # Every decision id is now remembered: a final redelivery applies nothing.
    executor = worker.open_executor(tmp_path, kind)
    assert all(executor.journal.is_done(d.decision_id) for d in todo)
    outcomes = executor.apply(todo[:50])
    assert {o.reason for o in outcomes} == {"duplicate decision id"}
    executor.close()
