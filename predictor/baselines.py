"""The reference policies every learned one is compared with: LRU, LFU, prefix LRU.

They keep a small exact state of their own (a hash -> slot dict over flat numpy
arrays), use logical clocks rather than timestamps so ties are broken exactly, and
score vectorised. Eviction order = ascending score, so each reproduces its cache:

- ``lru``: score = -(block accesses since the block's last access). Blocks of one
  request count in prefix order, as ``features.trace_stats.lru_hits`` does, so a cache
  that evicts the lowest score is exactly that LRU.
- ``lfu``: score = access count + a recency fraction in (0, 1), i.e. LFU with ties
  broken by LRU (exact while the fraction resolves in float32: short traces, tests).
- ``prefix_lru``: SGLang radix-cache style. A request touches its whole prefix, so a
  block's last request is the radix node's last access; among blocks last used by the
  same request the deepest (leaf) ranks lowest, as the radix tree evicts leaves first.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from features.events import BlocksAccessed, Event
from predictor.base import Policy, PolicyParams, as_hash_array


class _BlockTable:
    """Per-block last access (block and request clocks), count and chain depth."""

    def __init__(self, initial_capacity: int = 1024) -> None:
        self.slot_of: dict[int, int] = {}
        self.last_access = np.zeros(initial_capacity, dtype=np.int64)
        self.last_request = np.zeros(initial_capacity, dtype=np.int64)
        self.count = np.zeros(initial_capacity, dtype=np.int64)
        self.depth = np.zeros(initial_capacity, dtype=np.int64)
        self.num_accesses = 0
        self.num_requests = 0

    def _grow(self) -> None:
        size = 2 * self.last_access.shape[0]
        for name in ("last_access", "last_request", "count", "depth"):
            old = getattr(self, name)
            new = np.zeros(size, dtype=old.dtype)
            new[: old.shape[0]] = old
            setattr(self, name, new)

    def observe(self, event: BlocksAccessed) -> None:
        slot_of = self.slot_of
        for depth, block in enumerate(event.block_hashes):
            slot = slot_of.get(block)
            if slot is None:
                slot = len(slot_of)
                if slot >= self.last_access.shape[0]:
                    self._grow()
                slot_of[block] = slot
                self.depth[slot] = depth
            self.num_accesses += 1
            self.last_access[slot] = self.num_accesses
            self.last_request[slot] = self.num_requests + 1
            self.count[slot] += 1
        self.num_requests += 1

    def slots(self, block_hashes: np.ndarray) -> np.ndarray:
        """Slot per hash, -1 for blocks never seen."""
        get = self.slot_of.get
        return np.fromiter(
            (get(h, -1) for h in block_hashes.tolist()), dtype=np.int64, count=block_hashes.shape[0]
        )


class BaselineParams(PolicyParams):
    """LRU and LFU take no parameters."""


class PrefixLRUParams(PolicyParams):
    max_depth: int = Field(
        1023,
        ge=1,
        le=65535,
        description="Depths above this tie with it when breaking ties leaf-first. Larger "
        "values use more of float32's 24-bit mantissa per request of age.",
    )


class _TablePolicy(Policy):
    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        self._table = _BlockTable()

    def observe(self, event: Event) -> None:
        if isinstance(event, BlocksAccessed):
            self._table.observe(event)


class LRUPolicy(_TablePolicy):
    """Least recently used: the more recent the last access, the higher the score."""

    name = "lru"
    Params = BaselineParams

    def score(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        table = self._table
        slots = table.slots(as_hash_array(block_hashes))
        age = np.full(slots.shape[0], table.num_accesses + 1, dtype=np.int64)
        known = slots >= 0
        age[known] = table.num_accesses - table.last_access[slots[known]]
        return (-age).astype(np.float32)


class LFUPolicy(_TablePolicy):
    """Least frequently used, ties broken by recency: count + a fraction in (0, 1)."""

    name = "lfu"
    Params = BaselineParams

    def score(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        table = self._table
        slots = table.slots(as_hash_array(block_hashes))
        out = np.zeros(slots.shape[0], dtype=np.float64)
        known = slots >= 0
        picked = slots[known]
        out[known] = table.count[picked] + table.last_access[picked] / (table.num_accesses + 1.0)
        return out.astype(np.float32)


class PrefixLRUPolicy(_TablePolicy):
    """Radix-tree LRU: request-level recency, leaves (deeper blocks) first on ties."""

    name = "prefix_lru"
    Params = PrefixLRUParams
    params: PrefixLRUParams

    def score(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        table = self._table
        width = self.params.max_depth + 1
        slots = table.slots(as_hash_array(block_hashes))
        age = np.full(slots.shape[0], (table.num_requests + 1) * width, dtype=np.int64)
        known = slots >= 0
        picked = slots[known]
        age[known] = (table.num_requests - table.last_request[picked]) * width + np.minimum(
            table.depth[picked], self.params.max_depth
        )
        return (-age).astype(np.float32)
