"""Subprocess for the block group-commit crash test: opens the executor (running
recovery) and applies ``decisions()`` batch by batch through ``apply``, where moves
into the directory tiers are staged and committed as one group per batch. With a kill
point ``WHERE:N`` it SIGKILLs itself at the Nth such event, inside a batched apply:

- ``stage``: after the Nth temp file is written (nothing of the batch committed);
- ``sync``: after the Nth block file fsync of a group (some synced, none renamed);
- ``rename``: after the Nth rename of a group (names visible, not yet durable);
- ``dirsync``: after the Nth directory fsync (the group durable, no move finished);
- ``done``: after the Nth decision journaled done (the group half finished).

With KIND ``slab`` the tiers are slab tiers, and the kill points are:

- ``stage``: after the Nth slot written (not synced);
- ``sync``: after the Nth slab file sync (a group durable, no move finished);
- ``done``: as above.

Run to the end (kill point ``none``) it prints a JSON summary: outcome counts and where
every block ended.

Usage: python block_group_commit_worker.py ROOT KILL_POINT [directory|slab]
"""

from __future__ import annotations

import json
import os
import signal
import sys
import types
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from executor import Decision, Executor, ExecutorParams
from executor.journal import Journal
from executor.tier import Tier
from executor.tiers import directory, slab
from executor.tiers.directory import DirectoryTier, DirectoryTierParams
from executor.tiers.slab import SlabTier, SlabTierParams

KB = 1024
TIERS = ("dram", "nvme")
NUM_BLOCKS = 12


def block_size(block: int) -> int:
    return (8 + (block * 37) % 29) * KB


def open_executor(root: Path, kind: str = "directory") -> Executor:
    """Two durable disk tiers (``kind``: directory or slab) with room for every block,
    blocks and journal synced (the group commit's real path), one journal fsync per
    batch."""
    tiers: list[Tier] = [
        DirectoryTier(name, DirectoryTierParams(capacity_bytes=1 << 24, root=root / name))
        if kind == "directory"
        else SlabTier(name, SlabTierParams(capacity_bytes=1 << 24, root=root / name))
        for name in TIERS
    ]
    params = ExecutorParams(state_dir=root / "state", progress_interval_s=0)
    return Executor(tiers, params)


def decisions() -> list[list[Decision]]:
    """Every block demoted to nvme; then the even ones promoted back; then those
    demoted again: each batch moves several blocks into one directory tier."""
    demote = [Decision(f"a{b}", 0, b, "demote", "dram", "nvme") for b in range(NUM_BLOCKS)]
    evens = range(0, NUM_BLOCKS, 2)
    promote = [Decision(f"b{b}", 1, b, "promote", "nvme", "dram") for b in evens]
    again = [Decision(f"c{b}", 2, b, "demote", "dram", "nvme") for b in evens]
    return [demote, promote, again]


def _kill_at(where: str, n: int, kind: str) -> None:
    count = Counter[str]()

    def tick(event: str) -> None:
        count[event] += 1
        if event == where and count[event] == n:
            os.kill(os.getpid(), signal.SIGKILL)

    def after(event: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = fn(*args, **kwargs)
            tick(event)
            return result

        return wrapper

    Journal.decision_done = after("done", Journal.decision_done)  # type: ignore[method-assign]
    if kind == "slab":
        SlabTier._stage = after("stage", SlabTier._stage)  # type: ignore[method-assign]
        shim = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os)})
        shim.fdatasync = after("sync", os.fdatasync)
        slab.os = shim  # type: ignore[assignment]
        return
    stage, sync_file = DirectoryTier._stage, DirectoryTier._sync_file
    DirectoryTier._stage = after("stage", stage)  # type: ignore[method-assign]
    DirectoryTier._sync_file = after("sync", sync_file)  # type: ignore[method-assign]
    DirectoryTier._fsync_dir = after("dirsync", DirectoryTier._fsync_dir)  # type: ignore[method-assign]
    # Renames: the directory tier's own ``os``, with ``replace`` counted.
    shim = types.SimpleNamespace(**{name: getattr(os, name) for name in dir(os)})
    shim.replace = after("rename", os.replace)
    directory.os = shim  # type: ignore[assignment]


def main() -> None:
    root, kill_point = Path(sys.argv[1]), sys.argv[2]
    kind = sys.argv[3] if len(sys.argv) > 3 else "directory"
    executor = open_executor(root, kind)  # recovery runs before any kill point is armed
    if kill_point != "none":
        where, n = kill_point.split(":")
        _kill_at(where, int(n), kind)
    statuses: Counter[str] = Counter()
    for batch in decisions():
        for outcome in executor.apply(batch):
            statuses[outcome.status] += 1
    placement = {str(b): executor.locate(b) for b in range(NUM_BLOCKS)}
    executor.close()
    print(json.dumps({"statuses": dict(statuses), "placement": placement}))


if __name__ == "__main__":
    main()
