"""Flat arrays of a trace's block accesses and the oracle's next-access annotation.

Primitives:

- ``AccessArrays``: one row per block access, in order (request order, then prefix
  order within a request): dense block id, request index, timestamp, chain depth.
- ``access_arrays(events)``: build them from ``BlocksAccessed`` events.
- ``next_access_index(block_ids)``: for every access, the index of the next access
  of the same block (``len`` when there is none). Belady and the oracle policy need
  this; nothing else may see it.
- ``next_access_time(ts_ms, nxt)``: the same as a timestamp (``NEVER`` if none).
- ``next_access_from(block_ids, query_ids, query_pos)``: the next access of a block
  at or after any position (labels of snapshot samples in ``training.dataset``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from features.events import BlocksAccessed

NEVER = np.iinfo(np.int64).max
"""Sentinel for 'no next access' in time-valued annotations."""


@dataclass(frozen=True)
class AccessArrays:
    block_ids: np.ndarray  # int64 dense id per access (0..num_distinct-1, first-seen order)
    block_hashes: np.ndarray  # uint64 original hash per dense id
    request_index: np.ndarray  # int64 request ordinal per access
    ts_ms: np.ndarray  # int64 arrival time per access
    depth: np.ndarray  # int32 position of the block in its request's chain
    num_requests: int

    @property
    def num_accesses(self) -> int:
        return int(self.block_ids.shape[0])

    @property
    def num_distinct(self) -> int:
        return int(self.block_hashes.shape[0])


def access_arrays(events: Iterable[BlocksAccessed]) -> AccessArrays:
    hashes: list[int] = []
    lengths: list[int] = []
    times: list[int] = []
    for event in events:
        hashes.extend(event.block_hashes)
        lengths.append(len(event.block_hashes))
        times.append(event.ts_ms)
    raw = np.fromiter(hashes, dtype=np.uint64, count=len(hashes))
    lengths_arr = np.asarray(lengths, dtype=np.int64)
    request_index = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths_arr)
    ts_ms = np.repeat(np.asarray(times, dtype=np.int64), lengths_arr)
    starts = (
        np.concatenate([[0], np.cumsum(lengths_arr)[:-1]]) if lengths else np.zeros(0, np.int64)
    )
    depth = (np.arange(raw.shape[0], dtype=np.int64) - np.repeat(starts, lengths_arr)).astype(
        np.int32
    )
    # Dense ids in first-seen order, so ids are stable under appending to the trace.
    uniq, first_pos, inverse = np.unique(raw, return_index=True, return_inverse=True)
    order = np.argsort(first_pos, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.shape[0])
    block_ids = rank[inverse].astype(np.int64)
    return AccessArrays(
        block_ids=block_ids,
        block_hashes=uniq[order],
        request_index=request_index,
        ts_ms=ts_ms,
        depth=depth,
        num_requests=len(lengths),
    )


def next_access_index(block_ids: np.ndarray) -> np.ndarray:
    """Index of the next access of the same block, or ``len(block_ids)`` if none."""
    n = block_ids.shape[0]
    order = np.argsort(block_ids, kind="stable")
    nxt = np.full(n, n, dtype=np.int64)
    same = block_ids[order[1:]] == block_ids[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def next_access_time(ts_ms: np.ndarray, nxt: np.ndarray) -> np.ndarray:
    """Timestamp of the next access per access; ``NEVER`` when there is none."""
    n = ts_ms.shape[0]
    out = np.full(n, NEVER, dtype=np.int64)
    has = nxt < n
    out[has] = ts_ms[nxt[has]]
    return out


def next_access_from(
    block_ids: np.ndarray, query_ids: np.ndarray, query_pos: np.ndarray
) -> np.ndarray:
    """For each query (dense block id, position p): the index of the first access of
    that block at an index >= p, or ``len(block_ids)`` if none. Snapshot samples taken
    after ``p`` accesses were observed ask this with their block and ``p``."""
    n = block_ids.shape[0]
    order = np.argsort(block_ids, kind="stable")  # by block, then by position
    ids_sorted = block_ids[order]
    key = ids_sorted.astype(np.int64) * (n + 1) + order
    q = np.asarray(query_ids, dtype=np.int64) * (n + 1) + np.asarray(query_pos, dtype=np.int64)
    j = np.searchsorted(key, q, side="left")
    jc = np.minimum(j, max(n - 1, 0))
    hit = (j < n) & (ids_sorted[jc] == query_ids) if n else np.zeros(q.shape[0], dtype=bool)
    return np.where(hit, order[jc] if n else 0, n).astype(np.int64)
