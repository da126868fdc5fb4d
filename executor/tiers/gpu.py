"""``GpuTier``: the HBM tier. Uses torch device memory where a CUDA device is present
and is simulated in host memory elsewhere (same interface, same capacity rules), so
the executor and its tests run on any machine.

torch is imported only here, and only when ``device`` is ``"cuda"`` or ``"auto"``.
Payloads are uploaded as ``uint8`` tensors; the CRC32C is computed on the host before
upload and checked on the host copy after download, so what ``read`` returns is
exactly what was verified.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Literal

from executor.tier import BlockNotFoundError, Buffer, CorruptBlockError, Tier, TierParams, checksum


class CudaUnavailableError(RuntimeError):
    pass


@dataclass(frozen=True)
class GpuTierParams(TierParams):
    device: Literal["auto", "cuda", "simulated"] = "auto"
    """``cuda``: require a CUDA device; ``simulated``: host memory; ``auto``: CUDA when
    torch sees one, else simulated."""
    cuda_device_index: int = 0
    verify_reads: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.device not in ("auto", "cuda", "simulated"):
            raise ValueError(f"device must be auto, cuda or simulated, got {self.device!r}")
        if self.cuda_device_index < 0:
            raise ValueError("cuda_device_index must be >= 0")


def _cuda_torch() -> Any | None:
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    return torch if torch.cuda.is_available() else None


class GpuTier(Tier):
    Params = GpuTierParams
    params: GpuTierParams

    def __init__(self, name: str, params: GpuTierParams) -> None:
        super().__init__(name, params)
        self._torch = None if params.device == "simulated" else _cuda_torch()
        if params.device == "cuda" and self._torch is None:
            raise CudaUnavailableError(
                "GpuTier device='cuda' but torch sees no CUDA device; use device='auto' or 'simulated'"
            )
        self.on_cuda = self._torch is not None
        self.blocking_io = self.on_cuda  # simulated: host memory, as a memory tier
        self._device = f"cuda:{params.cuda_device_index}" if self.on_cuda else "cpu"
        self._blocks: dict[str, tuple[Any, int]] = {}

    def _read(self, key: str) -> tuple[Buffer, int]:
        try:
            stored, crc = self._blocks[key]
        except KeyError:
            raise BlockNotFoundError(self.name, key) from None
        data: Buffer = memoryview(stored.cpu().numpy()) if self.on_cuda else stored
        if self.params.verify_reads and checksum(data) != crc:
            self._blocks.pop(key, None)
            self._quarantine_index(key)
            raise CorruptBlockError(self.name, key, "crc32c mismatch")
        return data, crc

    def _commit(self, key: str, data: Buffer, crc: int | None) -> None:
        crc = checksum(data) if crc is None else crc
        if self.on_cuda:
            torch = self._torch
            assert torch is not None
            size = memoryview(data).nbytes
            # frombuffer wants a writable buffer; the copy is the pinned-less staging
            # a real engine would do with cudaMemcpy from host memory.
            host = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8)
                if size
                else torch.empty(0, dtype=torch.uint8)
            )
            stored: Any = host.to(self._device)
            torch.cuda.synchronize(self._device)
        else:
            stored = data if isinstance(data, bytes) else bytes(data)
        self._blocks[key] = (stored, crc)

    def _discard(self, key: str) -> None:
        self._blocks.pop(key, None)

    def close(self) -> None:
        self._blocks.clear()
