"""``SimulatedTier``: a ``Tier`` (same interface as the real ones) whose reads and
writes are also booked on a timing model against a ``SimClock``.

It stores payloads in memory like ``MemoryTier`` so the real ``Executor`` and the
tier contract tests run on it unchanged; each operation books the tier's read or
write ``Channel`` at ``clock.now_ms`` and records its completion in
``last_done_ms``. Replay at scale uses ``SimulatedExecutor`` instead, which keeps no
payloads at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from executor.sim.clock import SimClock
from executor.sim.profile import TierTiming, load_profile
from executor.tier import Buffer
from executor.tiers.memory import MemoryTier, MemoryTierParams


@dataclass(frozen=True)
class SimulatedTierParams(MemoryTierParams):
    profile: str = "default"
    """Profile file whose ``[tiers.<name>]`` timing this tier uses (``default``: bundled)."""
    clock: SimClock = field(default_factory=SimClock, compare=False)
    """Simulated time; share one clock between the tiers of an executor."""


class SimulatedTier(MemoryTier):
    Params = SimulatedTierParams
    params: SimulatedTierParams

    def __init__(self, name: str, params: SimulatedTierParams) -> None:
        super().__init__(name, params)
        self.timing: TierTiming = load_profile(params.profile).tier(name)
        self.channels = self.timing.channels()
        self.last_done_ms = 0.0

    def _read(self, key: str) -> tuple[Buffer, int]:
        data, crc = super()._read(key)
        self.last_done_ms = self.channels.read.book(self.params.clock.now_ms, len(data))
        return data, crc

    def _commit(self, key: str, data: Buffer, crc: int | None) -> None:
        super()._commit(key, data, crc)
        size = memoryview(data).nbytes
        self.last_done_ms = self.channels.write.book(self.params.clock.now_ms, size)
