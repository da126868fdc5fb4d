"""Trace statistics and the two reference caches every result is measured between.

- ``lru_hits``: demand LRU, always admit (``lru_hit_flags``: which accesses hit).
- ``belady_hits``: Belady's MIN (evict the block whose next use is farthest), always
  admit, or with ``bypass=True`` (a block whose next use is farther than every
  resident's is not admitted: the optimum for equal-size blocks).
- ``trace_stats``: what ``kvwarm stats`` prints.

Capacity is counted in blocks; every access of every block in ``hash_ids`` order is
one access. These are the numbers the rest of kvwarm is compared against, so they
are kept simple and exact.
"""

from __future__ import annotations

import heapq
import math
import re
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from features.annotate import AccessArrays, next_access_index

DEFAULT_CAPACITIES = (0.01, 0.05, 0.1)


def lru_hits(block_ids: np.ndarray, capacity: int) -> int:
    """Hits of a demand LRU cache of ``capacity`` blocks."""
    return int(lru_hit_flags(block_ids, capacity).sum())


def lru_hit_flags(block_ids: np.ndarray, capacity: int) -> np.ndarray:
    """Per access of ``block_ids``: whether a demand LRU cache of ``capacity`` blocks
    hits it (bool)."""
    flags = np.zeros(len(block_ids), dtype=bool)
    if capacity <= 0:
        return flags
    cache: OrderedDict[int, None] = OrderedDict()
    hit_at: list[int] = []
    move = cache.move_to_end
    for i, block in enumerate(block_ids.tolist()):
        if block in cache:
            hit_at.append(i)
            move(block)
        else:
            cache[block] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    flags[hit_at] = True
    return flags


def belady_hits(
    block_ids: np.ndarray, capacity: int, nxt: np.ndarray | None = None, *, bypass: bool = False
) -> int:
    """Hits of Belady's MIN with ``capacity`` blocks.

    Lazy-deletion max-heap of (next use, block); a heap entry is live while it matches
    the block's current next use.
    """
    if capacity <= 0:
        return 0
    if nxt is None:
        nxt = next_access_index(block_ids)
    resident: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = 0
    push, pop = heapq.heappush, heapq.heappop
    for block, next_use in zip(block_ids.tolist(), nxt.tolist(), strict=True):
        if block in resident:
            hits += 1
        elif len(resident) >= capacity:
            # Find the live resident with the farthest next use.
            while True:
                neg_use, victim = heap[0]
                if resident.get(victim) == -neg_use:
                    break
                pop(heap)
            if bypass and next_use >= -neg_use:
                continue
            pop(heap)
            del resident[victim]
        resident[block] = next_use
        push(heap, (-next_use, block))
        # Bound the heap: rebuild when stale entries dominate.
        if len(heap) > 4 * capacity + 1024:
            heap = [(-u, b) for b, u in resident.items()]
            heapq.heapify(heap)
    return hits


@dataclass
class CapacityRow:
    fraction: float
    capacity_blocks: int
    lru_hit_ratio: float
    belady_hit_ratio: float


@dataclass
class TraceStats:
    num_requests: int
    time_span_s: float
    num_block_accesses: int
    num_distinct_blocks: int
    infinite_cache_hit_ratio: float
    reuse_distance_requests: dict[str, float]
    reuse_distance_s: dict[str, float]
    capacities: list[CapacityRow] = field(default_factory=list)
    num_rejects: int = 0
    rejects_by_reason: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percentiles(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def trace_stats(
    arrays: AccessArrays, capacities: tuple[float, ...] = DEFAULT_CAPACITIES
) -> TraceStats:
    n = arrays.num_accesses
    nxt = next_access_index(arrays.block_ids)
    has_next = nxt < n
    reuse_req = arrays.request_index[nxt[has_next]] - arrays.request_index[has_next]
    reuse_s = (arrays.ts_ms[nxt[has_next]] - arrays.ts_ms[has_next]) / 1000.0
    rows = []
    for fraction in capacities:
        cap = int(fraction * arrays.num_distinct)
        rows.append(
            CapacityRow(
                fraction=fraction,
                capacity_blocks=cap,
                lru_hit_ratio=lru_hits(arrays.block_ids, cap) / n if n else 0.0,
                belady_hit_ratio=belady_hits(arrays.block_ids, cap, nxt) / n if n else 0.0,
            )
        )
    span = (int(arrays.ts_ms.max()) - int(arrays.ts_ms.min())) / 1000.0 if n else 0.0
    return TraceStats(
        num_requests=arrays.num_requests,
        time_span_s=span,
        num_block_accesses=n,
        num_distinct_blocks=arrays.num_distinct,
        infinite_cache_hit_ratio=(n - arrays.num_distinct) / n if n else 0.0,
        reuse_distance_requests=_percentiles(reuse_req),
        reuse_distance_s=_percentiles(reuse_s),
        capacities=rows,
    )


def fmt_number(value: float | None, spec: str, missing: str = "-") -> str:
    """``format(value, spec)``, or ``missing`` (right-aligned to the spec's width) for
    None, NaN or infinity: tables never print ``nan`` or ``+nan%``."""
    if value is None or not math.isfinite(value):
        width = re.match(r"[<>^]?[+\- ]?(\d*)", spec.lstrip(">")).group(1)  # type: ignore[union-attr]
        return missing.rjust(int(width)) if width else missing
    return format(value, spec)


def format_stats(stats: TraceStats) -> str:
    rd_r, rd_s = stats.reuse_distance_requests, stats.reuse_distance_s
    lines = [
        f"requests                   {stats.num_requests:,}",
        f"time span                  {stats.time_span_s:,.0f} s",
        f"block accesses             {stats.num_block_accesses:,}",
        f"distinct blocks            {stats.num_distinct_blocks:,}",
        f"infinite-cache hit ratio   {stats.infinite_cache_hit_ratio:.4f}",
        "reuse distance (requests)  "
        + "  ".join(f"{k} {fmt_number(rd_r[k], ',.0f')}" for k in ("p50", "p90", "p99")),
        "reuse distance (seconds)   "
        + "  ".join(f"{k} {fmt_number(rd_s[k], ',.0f')}" for k in ("p50", "p90", "p99")),
    ]
    if stats.num_rejects:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(stats.rejects_by_reason.items()))
        lines.append(f"rejected rows              {stats.num_rejects:,} ({reasons})")
    lines.append("")
    lines.append(f"{'capacity':>9} {'blocks':>9} {'LRU':>8} {'Belady':>8}")
    for row in stats.capacities:
        lines.append(
            f"{row.fraction * 100:>8g}% {row.capacity_blocks:>9,} {row.lru_hit_ratio:>8.4f} {row.belady_hit_ratio:>8.4f}"
        )
    return "\n".join(lines)
