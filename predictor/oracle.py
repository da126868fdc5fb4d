"""The oracle: scores blocks by their true next access. Evaluation only.

It is the upper reference in every report (Belady-style ranking plus perfect
prefetch). It needs the next-access annotation of the whole trace
(``FutureAccesses``), which no live system has: without it ``score`` raises
``OracleNeedsFutureError``, and ``needs_future = True`` tells serving to refuse it.

Score = H / (H + time to next access), in (0, 1]; 0 for blocks never accessed again
(or unknown). "Next" is the next access after the events observed so far (stream
order), so the oracle must observe the stream like any policy. Monotone in the time to
next access, so its ranking is Belady's.
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
    """Every access of every block of a trace, queryable for "the next access of this
    block after the first ``position`` accesses of the stream".

    Positions count block accesses in stream order (request order, then prefix order),
    so "next" means by a later request even when timestamps tie (coarse trace clocks),
    the convention of ``training.dataset`` labels. Stored as one sorted int64 key per
    access, ``dense_id * (n + 1) + position``, so a batch query is one ``searchsorted``.
    """

    def __init__(self, arrays: AccessArrays) -> None:
        n = arrays.num_accesses
        self.num_accesses = n
        order = np.argsort(arrays.block_hashes, kind="stable")
        self.block_hashes_sorted: np.ndarray = arrays.block_hashes[order]
        rank = np.empty_like(order)
        rank[order] = np.arange(order.shape[0])
        ids = rank[arrays.block_ids].astype(np.int64) if n else np.zeros(0, np.int64)
        if n and (int(ids.max()) + 1) * (n + 1) >= np.iinfo(np.int64).max:
            raise OverflowError("too many accesses for the oracle's int64 keys")
        keys = ids * (n + 1) + np.arange(n, dtype=np.int64)
        sort = np.argsort(keys, kind="stable")
        self._keys = keys[sort]
        self._ts_ms = arrays.ts_ms.astype(np.int64)[sort]

    @classmethod
    def from_events(cls, events: Iterable[Event]) -> FutureAccesses:
        return cls(access_arrays(e for e in events if isinstance(e, BlocksAccessed)))

    def next_access_ms(self, block_hashes: np.ndarray, position: int) -> np.ndarray:
        """Time of each block's first access at stream position >= ``position`` (after
        ``position`` accesses were observed); -1 when there is none."""
        hashes = as_hash_array(block_hashes)
        out = np.full(hashes.shape[0], -1, dtype=np.int64)
        if self._keys.shape[0] == 0 or hashes.shape[0] == 0:
            return out
        width = self.num_accesses + 1
        pos = np.searchsorted(self.block_hashes_sorted, hashes)
        pos_c = np.minimum(pos, self.block_hashes_sorted.shape[0] - 1)
        known = self.block_hashes_sorted[pos_c] == hashes
        ids = pos_c[known].astype(np.int64)
        at = min(max(int(position), 0), self.num_accesses)
        found = np.searchsorted(self._keys, ids * width + at, side="left")
        found_c = np.minimum(found, self._keys.shape[0] - 1)
        same = (found < self._keys.shape[0]) & (self._keys[found_c] // width == ids)
        out[known] = np.where(same, self._ts_ms[found_c], -1)
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
        self.position = 0

    def attach_future(self, future: FutureAccesses) -> None:
        self.future = future

    def observe(self, event: Event) -> None:
        """Counts block accesses: the stream position its annotation is read at."""
        if isinstance(event, BlocksAccessed):
            self.position += len(event.block_hashes)

    def score(self, block_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        if self.future is None:
            raise OracleNeedsFutureError(
                "the oracle needs the next-access annotation: build "
                "FutureAccesses.from_events(trace events) and pass future=... "
                "(evaluation only; serving refuses the oracle)"
            )
        nxt = self.future.next_access_ms(block_hashes, self.position)
        horizon = float(self.params.horizon_ms)
        gap = np.maximum(nxt - int(now_ms), 0).astype(np.float64)
        out = np.where(nxt >= 0, horizon / (horizon + gap), 0.0)
        return out.astype(np.float32)
