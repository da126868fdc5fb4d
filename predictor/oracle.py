"""The oracle: scores blocks by their true next access. Evaluation only.

It is the upper reference in every report (Belady-style ranking plus perfect
prefetch). It needs the next-access annotation of the whole trace
(``FutureAccesses``), which no live system has: without it ``score`` raises
``OracleNeedsFutureError``, and ``needs_future = True`` tells serving to refuse it.

Score = H / (H + time to next access), in (0, 1]; 0 for blocks never accessed again
after ``now_ms`` (or unknown). Monotone in the time to next access, so its ranking is
Belady's.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from pydantic import Field

from features.annotate import AccessArrays, access_arrays
from features.events import BlocksAccessed, Event
from predictor.base import Policy, PolicyError, PolicyParams, as_hash_array


class OracleNeedsFutureError(PolicyError):
    """The oracle was asked to score without the next-access annotation."""


class FutureAccesses:
    """Every access time of every block of a trace, queryable for "next access after t".

    Stored as one sorted int64 key per access, ``dense_id * span + (ts - t0 + 1)``, so a
    batch of (block, now) queries is one ``searchsorted``.
    """

    def __init__(self, arrays: AccessArrays) -> None:
        self.block_hashes_sorted: np.ndarray
        if arrays.num_accesses == 0:
            self.block_hashes_sorted = np.zeros(0, dtype=np.uint64)
            self._keys = np.zeros(0, dtype=np.int64)
            self._t0, self._span = 0, 1
            return
        ts = arrays.ts_ms.astype(np.int64)
        self._t0 = int(ts.min())
        self._span = int(ts.max()) - self._t0 + 2
        order = np.argsort(arrays.block_hashes, kind="stable")
        self.block_hashes_sorted = arrays.block_hashes[order]
        rank = np.empty_like(order)
        rank[order] = np.arange(order.shape[0])
        ids = rank[arrays.block_ids].astype(np.int64)
        if (int(ids.max()) + 1) * self._span >= np.iinfo(np.int64).max:
            raise OverflowError("trace too long or too many blocks for the oracle's int64 keys")
        self._keys = np.sort(ids * self._span + (ts - self._t0 + 1))

    @classmethod
    def from_events(cls, events: Iterable[Event]) -> FutureAccesses:
        return cls(access_arrays(e for e in events if isinstance(e, BlocksAccessed)))

    def next_access_ms(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        """Time of each block's first access strictly after ``now_ms``; -1 when none."""
        hashes = as_hash_array(block_hashes)
        out = np.full(hashes.shape[0], -1, dtype=np.int64)
        if self._keys.shape[0] == 0 or hashes.shape[0] == 0:
            return out
        pos = np.searchsorted(self.block_hashes_sorted, hashes)
        pos_c = np.minimum(pos, self.block_hashes_sorted.shape[0] - 1)
        known = self.block_hashes_sorted[pos_c] == hashes
        ids = pos_c[known].astype(np.int64)
        offset = min(max(int(now_ms) - self._t0 + 1, 0), self._span - 1)
        found = np.searchsorted(self._keys, ids * self._span + offset, side="right")
        found_c = np.minimum(found, self._keys.shape[0] - 1)
        key = self._keys[found_c]
        same = (found < self._keys.shape[0]) & (key // self._span == ids)
        nxt = np.where(same, key % self._span + self._t0 - 1, -1)
        out[known] = nxt
        return out


class OracleParams(PolicyParams):
    horizon_ms: int = Field(
        60_000, ge=1, description="Scale of the score: a block due in horizon_ms scores 0.5."
    )


class OraclePolicy(Policy):
    """Ranks by true time to next access. Needs ``future=FutureAccesses``; serving refuses it."""

    name = "oracle"
    Params = OracleParams
    params: OracleParams
    needs_future = True

    def __init__(
        self, params: PolicyParams | None = None, future: FutureAccesses | None = None
    ) -> None:
        super().__init__(params)
        self.future = future

    def attach_future(self, future: FutureAccesses) -> None:
        self.future = future

    def observe(self, event: Event) -> None:
        """Nothing to learn: the oracle reads the annotation."""

    def score(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        if self.future is None:
            raise OracleNeedsFutureError(
                "the oracle needs the next-access annotation: build "
                "FutureAccesses.from_events(trace events) and pass future=... "
                "(evaluation only; serving refuses the oracle)"
            )
        nxt = self.future.next_access_ms(block_hashes, now_ms)
        horizon = float(self.params.horizon_ms)
        gap = (nxt - int(now_ms)).astype(np.float64)
        out = np.where(nxt >= 0, horizon / (horizon + gap), 0.0)
        return out.astype(np.float32)
