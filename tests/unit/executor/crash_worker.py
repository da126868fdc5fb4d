"""Subprocess for the crash-injection test: opens the executor (running recovery) and
applies the seeded list of moves, eight at a time in parallel. The test SIGKILLs it
at random points (it prints one line per batch that did work, so the test can
kill it mid-run); run to completion it prints a JSON summary of the outcomes.

With KIND ``slab`` the dram and nvme tiers are slab tiers (blocks in slots of one file
per size) instead of directories of block files.

Usage: python crash_worker.py ROOT SEED NUM_BLOCKS NUM_MOVES [directory|slab]
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

from executor import Decision, Executor, ExecutorParams
from executor.tier import Tier
from executor.tiers.directory import (
    DirectoryTier,
    DirectoryTierParams,
    RemoteDirectoryTier,
    RemoteDirectoryTierParams,
)
from executor.tiers.slab import SlabTier, SlabTierParams

KB = 1024
TIERS = ("dram", "nvme", "remote")


def block_size(block: int) -> int:
    return (16 + (block * 37) % 113) * KB


def open_executor(root: Path, kind: str = "directory") -> Executor:
    """Three durable tiers (a directory, or with ``kind`` slab a slab tier, stands for
    dram and nvme), small enough that promotes have to demote. fsync is off: SIGKILL
    loses nothing the kernel already has."""

    def disk(name: str, cap: int) -> Tier:
        if kind == "slab":
            return SlabTier(name, SlabTierParams(capacity_bytes=cap, root=root / name, fsync=False))
        return DirectoryTier(
            name, DirectoryTierParams(capacity_bytes=cap, root=root / name, fsync=False)
        )

    tiers = [
        disk("dram", 1500 * KB),
        disk("nvme", 4000 * KB),
        RemoteDirectoryTier(
            "remote",
            RemoteDirectoryTierParams(capacity_bytes=1 << 30, root=root / "remote", fsync=False),
        ),
    ]
    return Executor(tiers, ExecutorParams(state_dir=root / "state", fsync_journal=False))


def decisions(seed: int, num_blocks: int, num_moves: int) -> list[Decision]:
    rng = random.Random(seed)
    out = []
    for i in range(num_moves):
        block = rng.randrange(num_blocks)
        action, to = rng.choice(
            [("promote", "dram"), ("promote", "nvme"), ("demote", "nvme"), ("demote", "remote")]
        )
        out.append(Decision(f"move-{i:05d}", i, block, action, None, to))  # type: ignore[arg-type]
    return out


def main() -> None:
    root, seed, num_blocks, num_moves = Path(sys.argv[1]), *map(int, sys.argv[2:5])
    executor = open_executor(root, sys.argv[5] if len(sys.argv) > 5 else "directory")
    todo = decisions(seed, num_blocks, num_moves)
    statuses: Counter[str] = Counter()
    for start in range(0, len(todo), 8):
        batch = executor.apply(todo[start : start + 8])
        for outcome in batch:
            statuses[outcome.status] += 1
        if any(o.reason != "duplicate decision id" for o in batch):
            print("batch", flush=True)  # progress: the test kills after some of these
    executor.close()
    print(json.dumps(dict(statuses)))


if __name__ == "__main__":
    main()
