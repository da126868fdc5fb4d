"""Tier factories shared by the executor tests: one of each kind, small capacities."""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from executor.sim.clock import SimClock
from executor.sim.tier import SimulatedTier, SimulatedTierParams
from executor.tier import Tier
from executor.tiers.directory import (
    DirectoryTier,
    DirectoryTierParams,
    RemoteDirectoryTier,
    RemoteDirectoryTierParams,
)
from executor.tiers.gpu import GpuTier, GpuTierParams
from executor.tiers.memory import MemoryTier, MemoryTierParams
from executor.tiers.slab import SlabTier, SlabTierParams

TierFactory = Callable[[str, int], Tier]


def payload(block: int | str, size: int) -> bytes:
    """Deterministic bytes for a block, so any reader can check content."""
    seed = hashlib.sha256(str(block).encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def load_worker(path: Path) -> ModuleType:
    """A crash test's worker script loaded as a module, for its helpers (the tests run
    in importlib mode, where a sibling file cannot be imported by name)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(name="load_worker")
def load_worker_fixture() -> Callable[[Path], ModuleType]:
    """``load_worker(path)``: a worker script's module (see ``load_worker``)."""
    return load_worker


@pytest.fixture(name="payload")
def payload_fixture() -> Callable[[int | str, int], bytes]:
    """``payload(block, size)``: deterministic bytes for a block."""
    return payload


def _factories(root: Path) -> dict[str, TierFactory]:
    return {
        "memory": lambda name, cap: MemoryTier(name, MemoryTierParams(capacity_bytes=cap)),
        "directory": lambda name, cap: DirectoryTier(
            name, DirectoryTierParams(capacity_bytes=cap, root=root / name, fsync=False)
        ),
        "slab": lambda name, cap: SlabTier(
            name, SlabTierParams(capacity_bytes=cap, root=root / f"{name}-slab", fsync=False)
        ),
        "remote": lambda name, cap: RemoteDirectoryTier(
            name,
            RemoteDirectoryTierParams(
                capacity_bytes=cap,
                root=root / f"{name}-remote",
                fsync=False,
                bandwidth_bytes_per_s=1e9,
            ),
        ),
        "gpu": lambda name, cap: GpuTier(
            name, GpuTierParams(capacity_bytes=cap, device="simulated")
        ),
        "simulated": lambda name, cap: SimulatedTier(
            name, SimulatedTierParams(capacity_bytes=cap, clock=SimClock())
        ),
    }


@pytest.fixture(params=["memory", "directory", "slab", "remote", "gpu", "simulated"])
def make_tier(request: pytest.FixtureRequest, tmp_path: Path) -> TierFactory:
    """Builds a tier of each kind in turn: the contract suite runs over all of them."""
    return _factories(tmp_path)[request.param]
