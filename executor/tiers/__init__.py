"""Tier implementations and a lazy registry by kind name.

``make_tier("directory", "nvme", {"root": "...", "capacity_bytes": 1 << 40})``
builds a tier from plain settings; importing this package imports no tier module
(the GPU tier imports torch only when it is built on a CUDA machine).
"""

from __future__ import annotations

import importlib
from typing import Any

from executor.tier import Tier

# kind -> "module:Class"
TIER_KINDS: dict[str, str] = {
    "memory": "executor.tiers.memory:MemoryTier",
    "directory": "executor.tiers.directory:DirectoryTier",
    "slab": "executor.tiers.slab:SlabTier",
    "remote": "executor.tiers.directory:RemoteDirectoryTier",
    "gpu": "executor.tiers.gpu:GpuTier",
    "simulated": "executor.sim.tier:SimulatedTier",
}


class UnknownTierKindError(ValueError):
    def __init__(self, kind: str) -> None:
        super().__init__(f"unknown tier kind {kind!r}; use one of {', '.join(sorted(TIER_KINDS))}")


def tier_class(kind: str) -> type[Tier]:
    if kind not in TIER_KINDS:
        raise UnknownTierKindError(kind)
    module_name, attr = TIER_KINDS[kind].split(":")
    cls = getattr(importlib.import_module(module_name), attr)
    assert issubclass(cls, Tier)
    return cls


def make_tier(kind: str, name: str, settings: dict[str, Any]) -> Tier:
    """Build a tier of ``kind`` named ``name`` from a dict of its ``Params`` fields."""
    cls = tier_class(kind)
    return cls(name, cls.Params(**settings))
