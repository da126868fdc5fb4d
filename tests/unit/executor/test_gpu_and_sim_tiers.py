"""The GPU tier's device choice, and the simulated tier's timing bookkeeping."""

from __future__ import annotations

import importlib.util

import pytest

from executor.sim.clock import SimClock
from executor.sim.profile import load_profile
from executor.sim.tier import SimulatedTier, SimulatedTierParams
from executor.tiers.gpu import CudaUnavailableError, GpuTier, GpuTierParams


@pytest.mark.slow  # imports torch
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_gpu_tier_uses_cuda_when_present_and_refuses_it_when_absent() -> None:
    import torch

    auto = GpuTier("hbm", GpuTierParams(capacity_bytes=1 << 20, device="auto"))
    assert auto.on_cuda == torch.cuda.is_available()
    if not torch.cuda.is_available():
        with pytest.raises(CudaUnavailableError, match="use device='auto' or 'simulated'"):
            GpuTier("hbm", GpuTierParams(capacity_bytes=1, device="cuda"))
    data = bytes(range(256)) * 100
    auto.write(3, data)
    auto.write(4, b"")
    assert bytes(auto.read(3)) == data and bytes(auto.read(4)) == b""
    assert auto.used_bytes == len(data)


def test_simulated_tier_books_its_channels_on_the_shared_clock() -> None:
    clock = SimClock(100.0)
    tier = SimulatedTier("nvme", SimulatedTierParams(capacity_bytes=1 << 30, clock=clock))
    timing = load_profile().tier("nvme")
    size = 4_000_000
    tier.write(1, b"\0" * size)
    write_ms = timing.latency_ms + size / timing.write_serial_bytes_per_s * 1000
    assert tier.last_done_ms == pytest.approx(100.0 + write_ms)
    clock.advance_to(500.0)
    tier.read(1)
    read_ms = timing.latency_ms + size / timing.read_serial_bytes_per_s * 1000
    assert tier.last_done_ms == pytest.approx(500.0 + read_ms)
    assert clock.advance_to(10.0) == 500.0  # time never goes back
