"""Replay: a trace through the real sidecar loop, with a simulated clock and tiers.

Replay is not a second implementation of any policy: every policy runs through
``serving.loop.Sidecar`` and ``serving.planner.Planner`` exactly as it would serve;
only the clock (event time) and the tiers (``Placement`` with a timing model) are
simulated.

Primitives:

- ``split_events(events, train_fraction)``: split by time (requests at one timestamp
  stay together), what trains vs what is replayed.
- ``replay_single_tier(...)``: the classic cache setting: one tier of
  ``capacity_blocks``, demand fills, hit ratio of block accesses.
- ``reference_hit_ratios(...)``: exact LRU, Belady (always admit) and Belady with
  bypass on the same block sequence, the bounds every result is quoted between;
  ``single_tier_references(...)``: those, LRU counted per request as the replay counts,
  and both LRUs request by request (what a paired interval resamples), in one pass.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from features.annotate import AccessArrays, access_arrays, next_access_index
from features.events import BlocksAccessed
from features.trace_stats import belady_hits, lru_hit_flags, lru_hits
from predictor.base import Policy
from serving.loop import Sidecar
from serving.placement import Placement
from serving.planner import Planner, PlannerParams

Progress = Callable[[int], None]


def split_events(
    events: Sequence[BlocksAccessed], train_fraction: float
) -> tuple[list[BlocksAccessed], list[BlocksAccessed]]:
    """First ``train_fraction`` of the trace's time span vs the rest.

    The cut is a timestamp, so requests sharing a timestamp land on one side.
    """
    if not events:
        return [], []
    if not 0.0 <= train_fraction < 1.0:
        raise ValueError(f"train fraction must be in [0, 1), got {train_fraction}")
    t0, t1 = events[0].ts_ms, events[-1].ts_ms
    cut = t0 + train_fraction * (t1 - t0)
    i = (
        next((k for k, e in enumerate(events) if e.ts_ms > cut), len(events))
        if train_fraction > 0
        else 0
    )
    return list(events[:i]), list(events[i:])


@dataclass
class SingleTierResult:
    policy: str
    capacity_blocks: int
    accesses: int
    hits: int
    seconds: float
    moves_by_kind: dict[str, int] = field(default_factory=dict)
    hits_by_request: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Hits of each replayed request, in order (what a paired interval resamples)."""

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def accesses_per_s(self) -> float:
        return self.accesses / self.seconds if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "accesses": self.accesses,
            "hits": self.hits,
            "hit_ratio": self.hit_ratio,
            "seconds": self.seconds,
            "accesses_per_s": self.accesses_per_s,
            "moves_by_kind": dict(self.moves_by_kind),
        }


def replay_single_tier(
    policy: Policy,
    events: Sequence[BlocksAccessed],
    capacity_blocks: int,
    *,
    planner_params: PlannerParams | None = None,
    progress: Progress | None = None,
    warm: Sequence[BlocksAccessed] = (),
) -> SingleTierResult:
    """Demand caching in one tier of ``capacity_blocks``: a block is a hit when it is in
    the tier as its request arrives; misses are computed and stored; the planner makes
    room by the policy's scores (and may veto keeping a block: admission). ``warm``:
    handled first through the same sidecar, uncounted, so the cache (and the policy)
    start ``events`` as they left it; empty, the cache starts empty."""
    placement = Placement(["hbm"], [capacity_blocks])
    sidecar = Sidecar(policy, Planner(planner_params), placement, prefetch=False, allow_future=True)
    for event in warm:
        sidecar.handle(event)
    sidecar.stats.moves_by_kind.clear()
    accesses = 0
    by_request: list[int] = []
    t0 = time.perf_counter()
    tier_of = placement.tier_of
    for i, event in enumerate(events):
        hits = 0
        for block in event.block_hashes:
            if tier_of(block) == 0:
                hits += 1
        by_request.append(hits)
        accesses += len(event.block_hashes)
        sidecar.handle(event)
        if progress is not None and i % 256 == 255:
            progress(256)
    if progress is not None:
        progress(len(events) % 256)
    return SingleTierResult(
        policy=policy.name,
        capacity_blocks=capacity_blocks,
        accesses=accesses,
        hits=sum(by_request),
        seconds=time.perf_counter() - t0,
        moves_by_kind=dict(sidecar.stats.moves_by_kind),
        hits_by_request=np.asarray(by_request, dtype=np.int64),
    )


def reference_hit_ratios(
    events: Sequence[BlocksAccessed], capacity_blocks: int
) -> dict[str, float]:
    """Exact LRU, Belady (always admit) and Belady with bypass on ``events``' blocks."""
    arrays = access_arrays(events)
    return _reference_ratios(arrays, lru_hits(arrays.block_ids, capacity_blocks), capacity_blocks)


def _reference_ratios(
    arrays: AccessArrays, lru_exact_hits: int, capacity_blocks: int
) -> dict[str, float]:
    """``reference_hit_ratios`` of ``access_arrays``' output, exact LRU's hits given."""
    n = arrays.num_accesses
    if n == 0:
        return {"lru_exact": 0.0, "belady": 0.0, "belady_bypass": 0.0}
    nxt = next_access_index(arrays.block_ids)
    return {
        "lru_exact": lru_exact_hits / n,
        "belady": belady_hits(arrays.block_ids, capacity_blocks, nxt) / n,
        "belady_bypass": belady_hits(arrays.block_ids, capacity_blocks, nxt, bypass=True) / n,
    }


@dataclass
class RequestHits:
    """Per request of a replayed part, in order."""

    accesses: np.ndarray
    lru_exact: np.ndarray
    """Hits under exact LRU access by access (``lru_exact``)."""
    lru_request: np.ndarray
    """Hits under LRU counted per request (``lru_request_hits_by_request``)."""


def single_tier_references(
    events: Sequence[BlocksAccessed], capacity_blocks: int
) -> tuple[dict[str, float], RequestHits]:
    """``reference_hit_ratios`` plus ``lru_request`` (LRU counted per request, what the
    planner's own ``lru`` hits), and both LRUs request by request: the access arrays
    built and exact LRU run once for all of it."""
    arrays = access_arrays(events)
    flags = lru_hit_flags(arrays.block_ids, capacity_blocks)
    refs = _reference_ratios(arrays, int(flags.sum()), capacity_blocks)
    per_request = arrays.request_index
    n = len(events)
    by_request = RequestHits(
        accesses=np.bincount(per_request, minlength=n).astype(np.int64),
        lru_exact=np.bincount(per_request, weights=flags, minlength=n).astype(np.int64),
        lru_request=lru_request_hits_by_request(events, capacity_blocks),
    )
    refs["lru_request"] = float(by_request.lru_request.sum() / max(1, arrays.num_accesses))
    return refs, by_request


def lru_request_hits_by_request(
    events: Sequence[BlocksAccessed], capacity_blocks: int
) -> np.ndarray:
    """Hits of each request under exact LRU serving a request at once, as the replay
    counts them (``replay_single_tier``): every access of a block present when the
    request arrives hits; then its blocks are read in order, the missing ones stored
    and the least recently read evicted. It is what ``lru`` through the planner hits,
    request by request. Exact LRU access by access (``lru_exact``, libCacheSim's
    count) can evict, while storing a request's first missing blocks, blocks that
    request reads further on: where requests are long against the cache (agent and
    diurnal at 1%) it hits less."""
    cache: OrderedDict[int, None] = OrderedDict()
    out = np.zeros(len(events), dtype=np.int64)
    if capacity_blocks <= 0:
        return out
    move = cache.move_to_end
    for i, event in enumerate(events):
        blocks = event.block_hashes
        out[i] = sum(block in cache for block in blocks)
        for block in blocks:
            if block in cache:
                move(block)
            else:
                cache[block] = None
                if len(cache) > capacity_blocks:
                    cache.popitem(last=False)
    return out


def gap_closed(value: float, low: float, high: float) -> float:
    """Share of the ``low`` (LRU) to ``high`` (Belady) gap that ``value`` closes."""
    return (value - low) / (high - low) if high > low else float("nan")


def distinct_blocks(events: Sequence[BlocksAccessed]) -> int:
    return int(
        np.unique(np.fromiter((b for e in events for b in e.block_hashes), dtype=np.uint64)).shape[
            0
        ]
    )


def spread_ties(events: Sequence[BlocksAccessed]) -> list[BlocksAccessed]:
    """Spread requests that share a timestamp evenly over the gap to the next distinct
    timestamp, keeping file order.

    Coarse traces (the Mooncake conversation trace has 1,180 distinct timestamps ~3 s
    apart for 12,031 requests) stamp many arrivals with one value; within one, file
    order is the truth. Spreading them keeps that order visible to the clock, so that
    queueing is not a burst of simultaneous arrivals and "next access after now" is
    well defined for the oracle. Every policy sees the same spread trace.
    """
    out: list[BlocksAccessed] = []
    n = len(events)
    i = 0
    while i < n:
        ts = events[i].ts_ms
        j = i
        while j < n and events[j].ts_ms == ts:
            j += 1
        span = (events[j].ts_ms - ts) if j < n else 1
        count = j - i
        for k in range(i, j):
            offset = ((k - i) * span) // count
            out.append(events[k] if offset == 0 else replace(events[k], ts_ms=ts + offset))
        i = j
    return out


# --- tiered replay with prefetch ---------------------------------------------------


def _input_tokens(event: BlocksAccessed) -> int:
    if event.input_tokens is not None:
        return event.input_tokens
    return len(event.block_hashes) * event.block_size_tokens


LOAD_WINDOW_REQUESTS = 100
"""Open-loop load is defined over windows holding this many requests on average."""
LOAD_QUANTILE = 0.9
"""... and set so that this share of the windows offer at most the target load."""


def time_scale_for_load(
    events: Sequence[BlocksAccessed],
    prefill_ms: Callable[[float], float],
    load: float,
    *,
    window_requests: int = LOAD_WINDOW_REQUESTS,
    quantile: float = LOAD_QUANTILE,
) -> float:
    """The factor to stretch inter-arrival times by so that, with nothing cached, the
    prefill work offered in a window of the trace keeps one node busy at most
    ``load`` of that window's time, in ``quantile`` of the windows.

    Windows, not the whole trace: a day-long bursty trace stretched to a mean load
    puts its bursts far above capacity, and TTFT then measures the queue. Windows are
    equal slices of the trace's time span holding ``window_requests`` requests on
    average (empty ones are skipped)."""
    span = events[-1].ts_ms - events[0].ts_ms if len(events) > 1 else 0
    if span <= 0:
        return 1.0
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must be in (0, 1], got {quantile}")
    num_windows = max(1, len(events) // max(1, window_requests))
    width_ms = span / num_windows
    work = np.zeros(num_windows + 1)
    t0 = events[0].ts_ms
    for e in events:
        work[int((e.ts_ms - t0) / width_ms)] += prefill_ms(_input_tokens(e))
    busy = work[work > 0]
    return float(np.quantile(busy, quantile)) / (width_ms * load)


def rescale_time(events: Sequence[BlocksAccessed], factor: float) -> list[BlocksAccessed]:
    """Stretch (factor > 1) or compress the arrival process, keeping order."""
    if not events or factor == 1.0:
        return list(events)
    t0 = events[0].ts_ms
    return [replace(e, ts_ms=t0 + int(round((e.ts_ms - t0) * factor))) for e in events]
