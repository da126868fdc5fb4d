"""``MemoryTier``: blocks held as ``bytes`` in this process (host DRAM).

The simplest tier, and the template in ``docs/adding-a-tier.md``. It is volatile:
after a restart it is empty, so a block whose only copy sat here is gone (that is
what DRAM is; keep a copy on a durable tier if that matters).
"""

from __future__ import annotations

from dataclasses import dataclass

from executor.tier import BlockNotFoundError, Buffer, CorruptBlockError, Tier, TierParams, checksum


@dataclass(frozen=True)
class MemoryTierParams(TierParams):
    verify_reads: bool = True
    """Recompute the CRC32C on every read. DRAM is ECC-protected, so turning this off
    trades a CPU pass over the payload (~1-2 GB/s per core) for trust in ECC."""


def _readonly(data: Buffer) -> bool:
    return isinstance(data, memoryview) and data.readonly and data.contiguous


class MemoryTier(Tier):
    Params = MemoryTierParams
    params: MemoryTierParams
    blocking_io = False

    def __init__(self, name: str, params: MemoryTierParams) -> None:
        super().__init__(name, params)
        self._blocks: dict[str, tuple[Buffer, int]] = {}

    def _read(self, key: str) -> tuple[Buffer, int]:
        try:
            data, crc = self._blocks[key]
        except KeyError:  # discarded between the index check and here
            raise BlockNotFoundError(self.name, key) from None
        if self.params.verify_reads and checksum(data) != crc:
            self._blocks.pop(key, None)
            self._quarantine_index(key)
            raise CorruptBlockError(self.name, key, "crc32c mismatch")
        return data, crc

    def _commit(self, key: str, data: Buffer, crc: int | None) -> None:
        # Keep immutable buffers as they are (a read-only view from another tier's read
        # is a private buffer); copy anything the caller could still change.
        payload = data if isinstance(data, bytes) or _readonly(data) else bytes(data)
        self._blocks[key] = (payload, checksum(payload) if crc is None else crc)

    def _discard(self, key: str) -> None:
        self._blocks.pop(key, None)
