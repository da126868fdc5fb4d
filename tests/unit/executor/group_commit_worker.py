"""Subprocess for the group-commit crash test: opens the executor (running recovery)
and applies a seeded list of moves in batches of ``BATCH`` through ``apply`` (one
journal fsync per batch). Before each batch it prints ``start N``, after it ``end N``,
so the test can SIGKILL it at a random point inside a batch. Run to the end it prints
a JSON summary: outcome counts and where every block ended.

Usage: python group_commit_worker.py ROOT SEED NUM_BLOCKS NUM_MOVES
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

from executor import Decision, Executor, ExecutorParams
from executor.tiers.directory import DirectoryTier, DirectoryTierParams

KB = 1024
TIERS = ("dram", "nvme", "remote")
BATCH = 64


def block_size(block: int) -> int:
    return (4 + (block * 37) % 29) * KB


def open_executor(root: Path) -> Executor:
    """Three durable directory tiers with room for every block (no demotion to make
    room, so the final placement depends only on the decisions), journal fsynced with
    group commit. Block fsync is off: a SIGKILL loses nothing the kernel has."""
    tiers = [
        DirectoryTier(
            name, DirectoryTierParams(capacity_bytes=1 << 30, root=root / name, fsync=False)
        )
        for name in TIERS
    ]
    params = ExecutorParams(
        state_dir=root / "state", fsync_journal=True, group_commit=True, progress_interval_s=0
    )
    return Executor(tiers, params)


def decisions(seed: int, num_blocks: int, num_moves: int) -> list[Decision]:
    rng = random.Random(seed)
    out = []
    for i in range(num_moves):
        block = rng.randrange(num_blocks)
        action, to = rng.choice(
            [("promote", "dram"), ("promote", "nvme"), ("demote", "nvme"), ("demote", "remote")]
        )
        out.append(Decision(f"gc-{i:05d}", i, block, action, None, to))  # type: ignore[arg-type]
    return out


def main() -> None:
    root, seed, num_blocks, num_moves = Path(sys.argv[1]), *map(int, sys.argv[2:5])
    executor = open_executor(root)
    todo = decisions(seed, num_blocks, num_moves)
    statuses: Counter[str] = Counter()
    for n, start in enumerate(range(0, len(todo), BATCH)):
        print(f"start {n}", flush=True)
        for outcome in executor.apply(todo[start : start + BATCH]):
            statuses[outcome.status] += 1
        print(f"end {n}", flush=True)
    placement = {str(b): executor.locate(b) for b in range(num_blocks)}
    num_fsyncs = executor.journal.num_fsyncs
    executor.close()
    print(json.dumps({"statuses": dict(statuses), "placement": placement, "fsyncs": num_fsyncs}))


if __name__ == "__main__":
    main()
